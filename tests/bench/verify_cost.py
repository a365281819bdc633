"""Benchmark (a script, not a test): what verify's every-file content checks cost next to the extraction of the
same data on the same machine, and whether they raise a false alarm on it.

    .venv/bin/python tests/bench/verify_cost.py --config configs/smollm2-cpu.toml [--repeats 3] [--set k=v ...]
        [--read-workers 1,2]

Needs the run's extract step done (e.g. `python -m pipeline extract --config ...`). Runs verify --force
`repeats` times and prints, per run, verify's content-check seconds (summary content_checks_s: reading every file,
zero rows, duplicate hashes, the head on sampled positions, the prefix forward passes; not the full parity on the
sample, which existed before) against the extract step's seconds and its pure extraction seconds (extract_s,
server start excluded). --read-workers runs each repeat once per verify.read_workers value (threads reading and
checking files ahead of the model checks) and says whether every summary but the seconds is the same.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    from pipeline.env import setup_env

    setup_env()
    from pipeline.config import load_config
    from pipeline.manifest import StepError
    from pipeline.steps import run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-cpu.toml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--read-workers", default="", help="comma-separated verify.read_workers values (default: the config's)")
    args = ap.parse_args()
    from pipeline.__main__ import parse_set

    cfg = load_config(args.config, parse_set(args.set))
    ext = json.loads((cfg.step_dir("extract") / "manifest.json").read_text())
    step_s, pure_s = ext["seconds"], ext["summary"]["extract_s"]
    summaries = {}
    for k in range(args.repeats):
        for w in [int(x) for x in args.read_workers.split(",") if x] or [cfg.verify.read_workers]:
            cfg.verify.read_workers = w
            try:
                v = run(cfg, "verify", force=True)
            except StepError as e:
                print(f"RUN {k}: FALSE ALARM on clean data: {e}", flush=True)
                continue
            s = v["summary"]
            c = s["content_checks_s"]
            summaries[k, w] = {key: val for key, val in s.items()
                               if key not in ("content_checks_s", "content_read_wait_s", "read_workers")}
            print(f"RUN {k} (read_workers {w or 'auto'}): {s['files_checked']} files, {s['tokens_checked']} tokens; "
                  f"content checks {c:.1f} s = {100 * c / step_s:.1f} % of the extract step ({step_s:.1f} s), "
                  f"{100 * c / pure_s:.1f} % of its pure extraction time ({pure_s:.1f} s, server start excluded); "
                  f"verify step {v['seconds']:.1f} s, of which {s['content_read_wait_s']:.1f} s waiting for the "
                  f"readers; false alarms 0", flush=True)
    same = len({json.dumps(x, sort_keys=True) for x in summaries.values()}) <= 1
    print(f"summaries (all but the seconds) {'identical' if same else 'DIFFER'} across {len(summaries)} runs")


if __name__ == "__main__":
    main()
