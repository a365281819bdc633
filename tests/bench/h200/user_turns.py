"""The staged ShareGPT input of the device runs: every conversation of the packaged ShareGPT with its user turns
and every answer replaced by prompt_sets' placeholder (the runs regenerate all of them, data.regenerate =
"all_turns"), so the data travels in one 7-MB file beside a model piece.

    python3 tests/bench/h200/user_turns.py [--stack vllm-0.32] [--out .gpu/sharegpt-user-turns.jsonl.gz]

Session 8 staged such a file by hand; session 13 found the ignored .gpu/ gone with a new checkout, so it is now
made by this script (deterministic: the same package gives the same bytes). Ids are the package's, so a run's
train/eval split by id is the same as with the file of earlier sessions. Blanking the answers makes 305
conversations duplicates of others (same user turns), which prepare then drops (session 8: 16,579 records,
16,274 usable).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from pipeline.datasets import load_conversations  # noqa: E402
from pipeline.prompt_sets import PLACEHOLDER  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="vllm-0.32")
    ap.add_argument("--out", default=".gpu/sharegpt-user-turns.jsonl.gz")
    a = ap.parse_args()
    convs, report = load_conversations(a.stack)
    lines = []
    for c in convs:
        msgs = [{"role": m["role"], "content": PLACEHOLDER if m["role"] == "assistant" else m["content"]}
                for m in c["messages"]]
        lines.append(json.dumps({"id": c["id"], "messages": msgs}, ensure_ascii=False))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))
    print(f"{out}: {len(lines)} conversations ({report.source}, sha256 {report.sha256[:12]}), "
          f"{out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
