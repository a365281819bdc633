"""Where prepare's time goes when nothing is regenerated (the seed has every answer): loading and selecting the
sources (de-duplication, the MT-bench near-duplicate check), then tokenizing each conversation with its loss mask.

    .venv/bin/python tests/bench/prepare_phases.py CONVERSATIONS.jsonl[.gz] [N] [--config C --set k=v ...]

CONVERSATIONS: a prepare/conversations.jsonl (the device returns it as regen.jsonl.gz.part.aa); its first N
conversations are tokenized as prepare does, one by one (`chat.tokenize_conversation`) and, with --workers W, by
`chat.tokenize_conversations` on W processes (results compared); the one-by-one seconds are also scaled to the
whole file. With --select (and --config/--set as the run had them), `prepare.selected_conversations` is timed too.
"""
import argparse
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.env import setup_env  # noqa: E402

setup_env()
from pipeline.__main__ import parse_set  # noqa: E402
from pipeline.chat import tokenize_conversation, tokenize_conversations  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.prepare import load_tokenizer, reasoning_mode, selected_conversations  # noqa: E402

def main() -> None:  # a guard: tokenize_conversations' spawned workers import this file
    ap = argparse.ArgumentParser()
    ap.add_argument("conversations", type=Path)
    ap.add_argument("n", type=int, nargs="?", default=2000)
    ap.add_argument("--config", default="configs/smollm2-quality-h200.toml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--select", action="store_true", help="also time selected_conversations (reads every source)")
    ap.add_argument("--workers", type=int, default=0, help="also time tokenize_conversations on this many processes")
    args = ap.parse_args()
    cfg = load_config(args.config, parse_set(args.set))
    tok = load_tokenizer(cfg)
    with open(args.conversations, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open if gz else open)(args.conversations, "rt") as f:
        convs = [json.loads(line) for line in f]
    if args.select:
        t = time.time()
        selected, report, contaminated = selected_conversations(cfg)
        print(f"selected_conversations: {time.time() - t:.1f} s ({len(selected)} conversations)")
    sample = convs[: args.n]
    reasoning = reasoning_mode(cfg)
    t = time.time()
    tokens = 0
    for c in sample:
        tokens += len(tokenize_conversation(tok, c["messages"], cfg.data.seq_length, tools=c.get("tools"),
                                            reasoning=reasoning).input_ids)
    dt = time.time() - t
    print(f"tokenize_conversation: {dt:.1f} s for {len(sample)} conversations ({tokens} tokens), "
          f"{1e3 * dt / len(sample):.2f} ms each: {dt * len(convs) / len(sample):.0f} s for all {len(convs)}")
    if args.workers:
        items = [(c["messages"], c.get("tools")) for c in sample]
        t = time.time()
        many = tokenize_conversations(tok, items, cfg.data.seq_length, reasoning=reasoning, workers=args.workers)
        dw = time.time() - t
        one = [tokenize_conversation(tok, m, cfg.data.seq_length, tools=tl, reasoning=reasoning) for m, tl in items]
        print(f"tokenize_conversations, {args.workers} processes: {dw:.1f} s for {len(sample)} (start-up included), "
              f"{dt / dw:.2f}x; results equal: {many == one}")


if __name__ == "__main__":
    main()
