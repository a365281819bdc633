"""How many held-out eval prompts also occur, verbatim, as a user turn of a training conversation.

    python tests/bench/heldout_overlap.py --config C [--set k=v ...]

The held-out prompts are exactly the ones `python -m pipeline.evaluate --set eval.prompts=heldout` serves (the first
user turns of the run's eval split, data.sources' order, eval.max_prompts of them). prepare de-duplicates whole
conversations, and ShareGPT holds the same question under several ids, so a held-out first turn can be a training
turn too; this counts them (whitespace collapsed, case-folded), so a held-out figure can say how clean it is.
"""
import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.env import setup_env  # noqa: E402

setup_env()
from pipeline.__main__ import parse_set  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluate import first_turns  # noqa: E402
from pipeline.prepare import selected_conversations  # noqa: E402
from pipeline.prompt_sets import normalise  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    cfg = load_config(a.config, parse_set(a.set + ["eval.prompts=heldout"]))
    convs = selected_conversations(cfg)[0]
    trained = {normalise(m["content"]) for c in convs if c["split"] == "train" for m in c["messages"] if m["role"] == "user"}
    held = first_turns(cfg)
    tags = Counter(str(c.get("source", "-")) for c in convs if c["split"] == "eval")
    hits = [h[-1]["content"] for h in held if normalise(h[-1]["content"]) in trained]  # h ends with its user turn
    print(f"{len(held)} held-out first turns (eval split by source: {dict(tags)}); {len(hits)} occur verbatim as a "
          f"user turn of a training conversation")
    for h in hits:
        print(f"  - {h[:100]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
