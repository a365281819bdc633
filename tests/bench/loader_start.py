"""How long speculators' training loader takes to start its workers, with and without patch 0007.

    HF_HOME=$PWD/.cache/hf TMPDIR=$PWD/.cache/tmp .venv/bin/python tests/bench/loader_start.py [--rows 55773] [--workers 12]

speculators 0.9.0 starts its DataLoader workers with multiprocessing_context="spawn" (speculators.train.dataloader).
The parent writes each worker's pickled dataset into a pipe; a pickle over the pipe's 64 KiB blocks the parent until
that worker has imported torch and speculators, so the workers start one after another. The train dataset's
approx_lengths (one int per sample) make its pickle 151.5 kB at 54,713 samples (the defaults); patch 0007 leaves them
out of it (2.1 kB).

Builds an Arrow dataset of --rows rows (the layout prepare writes: input_ids, loss_mask, seq_len) under
.cache/bench-loader/, then times iter() over speculators' own _setup_dataloader as installed (patched, if the series
is applied) and with the patch's __getstate__ taken away (upstream 0.9.0). iter() returns once every worker has been
started: the parent's part of the first batch's wait; each worker's own imports come after, in parallel. No batch is
read: the hidden-state files do not exist.
"""
from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dataset(rows: int):
    import numpy as np
    from datasets import Dataset
    from speculators.train.data import ArrowDataset

    path = REPO / ".cache" / "bench-loader" / f"arrow-{rows}"
    if not path.exists():
        lens = np.random.default_rng(0).integers(64, 768, rows)
        Dataset.from_dict({"input_ids": [list(range(n)) for n in lens], "loss_mask": [[1] * n for n in lens],
                           "seq_len": lens.tolist()}).save_to_disk(str(path))
    return ArrowDataset(max_len=8192, datapath=path, on_missing="raise", train_ratio=0.981, split="train")


def start_seconds(ds, workers: int) -> float:
    from speculators.train.dataloader import _setup_dataloader

    loader = _setup_dataloader(ds, total_seq_len=8192, hidden_size=576, num_workers=workers)
    t = time.perf_counter()
    it = iter(loader)
    took = time.perf_counter() - t
    it._shutdown_workers()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=55773, help="rows of the dataset; the train split is 98.1 %% of them "
                    "(the default gives 54,713; session 44's run trained 55,750)")
    ap.add_argument("--workers", type=int, default=12, help="speculators' default data.num_workers")
    a = ap.parse_args()
    from speculators.train.data import BaseDataset

    ds = dataset(a.rows)
    patched = "__getstate__" in BaseDataset.__dict__
    runs = [("installed (patch 0007 applied)" if patched else "installed (no patch 0007)", None)]
    if patched:
        runs.append(("upstream 0.9.0 (the patch's __getstate__ taken away)", BaseDataset.__dict__["__getstate__"]))
    for name, getstate in runs:
        if getstate is not None:
            del BaseDataset.__getstate__
        try:
            size = len(pickle.dumps(ds))
            secs = start_seconds(ds, a.workers)
        finally:
            if getstate is not None:
                BaseDataset.__getstate__ = getstate
        print(f"{name}: {len(ds)} samples, dataset pickle {size:,} bytes, {a.workers} workers started in {secs:.1f} s")


if __name__ == "__main__":
    main()
