"""Benchmark (a script, not a test): what verify's every-file content checks cost next to the extraction of the
same data on the same machine, and whether they raise a false alarm on it.

    .venv/bin/python tests/bench/verify_cost.py --config configs/smollm2-cpu.toml [--repeats 3]

Needs the run's extract step done (e.g. `python -m pipeline extract --config ...`). Runs verify --force
`repeats` times and prints, per run, verify's content-check seconds (summary content_checks_s: reading every file,
zero rows, duplicate hashes, the head on sampled positions, the prefix forward passes; not the full parity on the
sample, which existed before) against the extract step's seconds and its pure extraction seconds (extract_s,
server start excluded).
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
    args = ap.parse_args()
    cfg = load_config(args.config)
    ext = json.loads((cfg.step_dir("extract") / "manifest.json").read_text())
    step_s, pure_s = ext["seconds"], ext["summary"]["extract_s"]
    for k in range(args.repeats):
        try:
            v = run(cfg, "verify", force=True)
        except StepError as e:
            print(f"RUN {k}: FALSE ALARM on clean data: {e}", flush=True)
            continue
        s = v["summary"]
        c = s["content_checks_s"]
        print(f"RUN {k}: {s['files_checked']} files, {s['tokens_checked']} tokens; content checks {c:.1f} s = "
              f"{100 * c / step_s:.1f} % of the extract step ({step_s:.1f} s), {100 * c / pure_s:.1f} % of its pure "
              f"extraction time ({pure_s:.1f} s, server start excluded); verify step {v['seconds']:.1f} s; "
              f"false alarms 0", flush=True)


if __name__ == "__main__":
    main()
