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
from pipeline.chat import prompt_ids  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.engines.vllm_offline import Generation  # noqa: E402
from pipeline.prepare import REGEN_CACHE, RegenCache, load_tokenizer  # noqa: E402
from pipeline.steps import fingerprint  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("conversations", type=Path)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, parse_set(args.set))
    assert cfg.data.regenerate == "first_turn", "the earlier answers are first-turn answers"
    tok = load_tokenizer(cfg)
    out = cfg.step_dir("prepare")
    out.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.conversations.suffix == ".gz" else open
    keys, gens = [], []
    with opener(args.conversations, "rt") as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            system = [m for m in msgs if m["role"] == "system"]
            first_user = next(m for m in msgs if m["role"] == "user")
            answer = next(m for m in msgs if m["role"] == "assistant")["content"]
            ids = tok.encode(answer, add_special_tokens=False)
            keys.append(RegenCache.key(0, prompt_ids(tok, system + [first_user])))
            gens.append(Generation(answer, ids, "length" if len(ids) >= cfg.data.max_new_tokens else "stop"))
    (out / REGEN_CACHE).unlink(missing_ok=True)
    cache = RegenCache(out / REGEN_CACHE)
    cache.add(keys, gens)
    cache.close()
    (out / ".fingerprint").write_text(fingerprint(cfg, "prepare"))
    print(f"[seed] {len(keys)} answers from {args.conversations} -> {out / REGEN_CACHE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
