"""Seed a run's `prepare` with the answers of an earlier regeneration, to save device time.

    python tests/bench/h200/seed_regen_cache.py --config C [--set k=v ...] CONVERSATIONS.jsonl[.gz]

CONVERSATIONS is an earlier run's `prepare/conversations.jsonl` (first-turn regeneration, same target, greedy).
Run it after the `model` step: it writes prepare's resume cache (`regenerated.partial.jsonl`) and the folder's
fingerprint, so the next `prepare` treats those answers as finished work of an interrupted run. Answers are keyed
by the exact prompt token ids (a prompt that differs in any token is regenerated), and prepare's manifest counts
them (`reused_from_interrupted_run`). The earlier run kept only the text: token ids are the text re-encoded and
`finish_reason` is "length" where that has data.max_new_tokens tokens, so the truncation count is approximate.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pipeline.env import setup_env  # noqa: E402

setup_env()  # caches inside the repo, before torch and transformers are imported
from pipeline.__main__ import parse_set  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.prepare import REGEN_CACHE, RegenCache  # noqa: E402
from pipeline.steps import fingerprint  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("conversations", type=Path)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, parse_set(args.set))
    assert cfg.data.regenerate == "first_turn", "the earlier answers are first-turn answers"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    out = cfg.step_dir("prepare")
    out.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.conversations.suffix == ".gz" else open
    n = 0
    with opener(args.conversations, "rt") as f, open(out / REGEN_CACHE, "w") as w:
        for line in f:
            msgs = json.loads(line)["messages"]
            system = [m for m in msgs if m["role"] == "system"]
            first_user = next(m for m in msgs if m["role"] == "user")
            answer = next(m for m in msgs if m["role"] == "assistant")["content"]
            prompt = tok.apply_chat_template(system + [first_user], tokenize=True, add_generation_prompt=True)
            if not isinstance(prompt, list):
                prompt = prompt["input_ids"]
            ids = tok.encode(answer, add_special_tokens=False)
            w.write(json.dumps({"key": RegenCache.key(0, prompt), "text": answer, "token_ids": ids,
                                "finish_reason": "length" if len(ids) >= cfg.data.max_new_tokens else "stop"}) + "\n")
            n += 1
    (out / ".fingerprint").write_text(fingerprint(cfg, "prepare"))
    print(f"[seed] {n} answers from {args.conversations} -> {out / REGEN_CACHE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
