"""How much of the target's greedy output a draft vocabulary can propose at all (issue 15: the 25-MB ship limit
caps a 2-layer draft at ~6,550 tokens; is a 1-layer draft with a larger vocabulary the better trade?).

    .venv/bin/python tests/bench/vocab_coverage.py EVAL_DIR [DRAFTER_DIR ...] [--conversations C.jsonl.gz]

EVAL_DIR is an eval step's folder (its baseline.result.json holds the target's greedy output token ids). For each
DRAFTER_DIR (a served-form drafter: model.safetensors with t2d) it prints the share of those output tokens inside
the drafter's vocabulary: a token outside it is never proposed, so every draft that needs it is rejected there.
With --conversations (a prepare step's conversations, e.g. the regenerated ones a device run sends back) it also
prints that share for the N most frequent tokens of their assistant turns, N from 4,096 to 16,384: the curve a
draft vocabulary built from that data would follow (the vocab step counts the train split's loss tokens of the
templated chats; counting each assistant message's text is close to it, not the same).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.env import setup_env  # noqa: E402

setup_env()  # caches inside the repo


def output_tokens(eval_dir: Path) -> Counter:
    res = json.loads((eval_dir / "baseline.result.json").read_text())
    return Counter(t for out in res["outputs"] for t in out)


def share(counts: Counter, vocab: set[int]) -> float:
    return sum(n for t, n in counts.items() if t in vocab) / sum(counts.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("drafters", type=Path, nargs="*")
    ap.add_argument("--conversations", type=Path)
    ap.add_argument("--model", type=Path, default=ROOT / "data" / "models" / "SmolLM2-135M-Instruct")
    a = ap.parse_args(argv)
    outs = output_tokens(a.eval_dir)
    print(f"{a.eval_dir}: {sum(outs.values()):,} greedy output tokens, {len(outs):,} distinct")
    from safetensors.torch import load_file

    for d in a.drafters:
        t2d = load_file(str(d / "model.safetensors")).get("t2d")
        if t2d is None:  # no vocab map: the drafter proposes over the target's whole vocabulary (widened)
            print(f"| {d} | the whole vocabulary | 1.0000 of the outputs |")
            continue
        vocab = set(t2d.nonzero().squeeze(1).tolist())
        print(f"| {d} | {len(vocab):,} tokens | {share(outs, vocab):.4f} of the outputs |")
    if a.conversations:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(a.model))
        freq: Counter = Counter()
        opener = gzip.open if a.conversations.suffix == ".gz" else open
        with opener(a.conversations, "rt") as f:
            texts = [m["content"] for ln in f for m in json.loads(ln)["messages"]
                     if m["role"] == "assistant" and m.get("content")]
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            freq.update(ids)
        ranked = [t for t, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))]
        print(f"{a.conversations}: {len(texts):,} assistant turns, {sum(freq.values()):,} tokens, {len(freq):,} distinct")
        print("| draft vocabulary (most frequent) | share of those turns | share of the outputs |")
        print("|---|---|---|")
        for n in (4096, 6144, 8192, 10240, 12288, 14336, 16384):
            top = set(ranked[:n])
            print(f"| {n:,} | {share(freq, top):.4f} | {share(outs, top):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
