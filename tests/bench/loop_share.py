"""How much of the training answers is the target looping, against what the evaluation decodes.

    python tests/bench/loop_share.py CONVERSATIONS.jsonl[.gz] [--eval-result DIR/baseline.result.json] [--limit N]

A token "repeats" when the 8-gram ending at it already occurred earlier in the same answer (a greedy 135M target
falls into loops: 59 % of its regenerated answers stop at the 256-token cap). Printed for the training answers as
stored, for their first 128 tokens (the length MT-bench is scored on), and for the target's own greedy MT-bench
outputs (the evaluator's baseline.result.json, token ids). A draft trained on loop-heavy text learns copying,
which teacher-forced accuracy rewards and MT-bench asks for less.
"""
import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.env import setup_env  # noqa: E402
from pipeline.loops import repeat_flags, terminal_loop  # noqa: E402

setup_env()  # caches inside the repo (transformers' import leaves a torchinductor folder in /tmp otherwise)


def repeated_share(ids: list[int]) -> tuple[int, int]:
    """(tokens whose ending 8-gram occurred earlier in ids, len(ids))."""
    return sum(repeat_flags(ids)), len(ids)


def share(pairs) -> str:
    rep = tot = 0
    for r, t in pairs:
        rep, tot = rep + r, tot + t
    return f"{rep / max(tot, 1):.3f} of {tot:,} tokens"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("conversations", type=Path)
    ap.add_argument("--eval-result", type=Path, help="an evaluator run's baseline.result.json (the target's outputs)")
    ap.add_argument("--limit", type=int, default=3000, help="conversations read (default 3000)")
    ap.add_argument("--model", default=str(ROOT / "data" / "models" / "SmolLM2-135M-Instruct"))
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    answers = []
    with (gzip.open if a.conversations.suffix == ".gz" else open)(a.conversations, "rt") as f:
        for k, line in enumerate(f):
            if k >= a.limit:
                break
            answers += [tok.encode(m["content"], add_special_tokens=False)
                        for m in json.loads(line)["messages"] if m["role"] == "assistant"]
    capped = sum(len(x) >= 256 for x in answers) / max(len(answers), 1)
    print(f"training answers ({len(answers):,}; {capped:.1%} at >= 256 tokens): repeating "
          f"{share(repeated_share(x) for x in answers)}; first 128 tokens: {share(repeated_share(x[:128]) for x in answers)}")
    tail = sum(terminal_loop(x) for x in answers)
    print(f"terminal loops (tails >= 32 tokens, >= 90 % repeats): {tail / max(sum(map(len, answers)), 1):.3f} of the "
          f"answer tokens, in {sum(terminal_loop(x) > 0 for x in answers) / max(len(answers), 1):.1%} of the answers")
    if a.eval_result:
        outs = json.loads(a.eval_result.read_text())["outputs"]
        print(f"target's greedy eval outputs ({len(outs)}): repeating {share(repeated_share(x) for x in outs)}; "
              f"terminal loops {sum(terminal_loop(x) for x in outs) / max(sum(map(len, outs)), 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
