"""Benchmark (a script, not a test): what extract's content hashes (extract/digests.json) cost.

    .venv/bin/python tests/bench/content_hash.py [--mib 1024] [--file-mib 16] [--workers 1,2,8]

Writes --mib MiB of random hidden-state-sized files into .cache/bench/content-hash, then times
pipeline.hidden_states.content_digests over them for each worker count: once with nothing known (every file
read and hashed, as after an extraction) and once with the digests just made (the reuse path: stat only).
The files were just written, so they are read from the page cache: this is the hashing cost, not the disk's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.hidden_states import content_digests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--file-mib", type=int, default=16)
    ap.add_argument("--workers", default="1,2,8")
    args = ap.parse_args()
    root = REPO / ".cache" / "bench" / "content-hash"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    names = []
    for k in range(max(1, args.mib // args.file_mib)):
        (root / f"hs_{k}.safetensors").write_bytes(os.urandom(args.file_mib << 20))
        names.append(f"hs_{k}.safetensors")
    total = len(names) * args.file_mib
    time.sleep(2.5)  # older than pipeline.hidden_states.RACY_NS when hashed, as all but the last files of an extraction
    rows = []
    for w in (int(x) for x in args.workers.split(",")):
        t = time.perf_counter()
        d = content_digests(root, names, {}, workers=w)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        content_digests(root, names, d, workers=w)
        reuse = time.perf_counter() - t
        rows.append({"workers": w, "mib": total, "hash_s": round(cold, 3), "mib_per_s": round(total / cold, 1),
                     "reuse_s": round(reuse, 4)})
        print(json.dumps(rows[-1]))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
