"""Benchmark (a script, not a test): how far a re-extraction of the same samples drifts from the first one.

    .venv/bin/python tests/bench/reextract_determinism.py [--repeats 8]

Needs the test suite's data run (.cache/test-runs/data, left by `make test` or
`pytest tests/test_data_pipeline.py`). Each repeat does what test_sharded_extraction_... does: copy the run,
delete shard 1/2's files, extract shard 0/2 (reuses) and 1/2 (a real vLLM server), then compares with the
first extraction (pipeline.compare.compare_extract) and prints bit-identical files, the worst per-file
per-layer mean cosine, the worst token cosine and how many token cosines fall below 0.999. Then verify runs on
the re-extraction (every check on every file): a failure there is a false alarm of verify's checks on clean data.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import clone_run  # noqa: E402  (sets up the caches before torch/vLLM load)


def main() -> None:
    from pipeline.compare import compare_extract
    from pipeline.config import load_config
    from pipeline.extract import load_samples, shard_of
    from pipeline.hidden_states import file_name
    from pipeline.manifest import StepError
    from pipeline.steps import run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    runs = REPO / ".cache" / "test-runs"
    data = load_config(runs / "data.toml")
    for k in range(args.repeats):
        shutil.rmtree(runs / "reextract", ignore_errors=True)
        cfg = clone_run(data, "reextract", runs)
        out = cfg.step_dir("extract")
        (out / "manifest.json").unlink()
        for split, i, _ in shard_of(load_samples(cfg), (1, 2)):
            (out / split / file_name(i)).unlink()
        run(cfg, "extract", shard=(0, 2))
        run(cfg, "extract", shard=(1, 2))
        c = compare_extract(data.step_dir("extract"), out)
        print(f"REPEAT {k}: {c['bit_identical']}/{c['files_compared']} bit-identical, worst layer mean cosine "
              f"{c['min_layer_mean_cosine']:.6f}, worst token {c['min_token_cosine']:.5f}, "
              f"{c['token_cosines_below_0.999']}/{c['token_cosines_compared']} token cosines below 0.999", flush=True)
        try:
            v = run(cfg, "verify", force=True)["summary"]
            print(f"REPEAT {k}: verify passed on {v['files_checked']} files (false alarms 0); checks {v['checks']}",
                  flush=True)
        except StepError as e:
            print(f"REPEAT {k}: VERIFY FALSE ALARM on clean data: {e}", flush=True)
    shutil.rmtree(runs / "reextract", ignore_errors=True)
    (runs / "reextract.toml").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
