"""Seed a run's `prepare` with the answers of an earlier regeneration, to save device time.

    python tests/bench/h200/seed_regen_cache.py --config C [--set k=v ...] CONVERSATIONS.jsonl[.gz]
    python tests/bench/h200/seed_regen_cache.py --answers-only CONVERSATIONS.jsonl[.gz] OUT.jsonl.gz

CONVERSATIONS is an earlier run's `prepare/conversations.jsonl` (same target, greedy; first-turn or all-turn
regeneration, as data.regenerate says: all turns are seeded round by round, each with the earlier answers in context),
or the answers-only form that `--answers-only` writes from one: `{"id", "answers": [...]}` per conversation, the
target's answers without the prompts (so the repository can keep a seed without redistributing the prompt sets:
data/seeds/). Seeding from that form takes the user turns from the config's own sources, by conversation id.
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
from pipeline.prepare import REGEN_CACHE, RegenCache, load_tokenizer, selected_conversations  # noqa: E402
from pipeline.steps import fingerprint  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] == ["--answers-only"] and len(argv) == 3:
        return answers_only(Path(argv[1]), Path(argv[2]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("conversations", type=Path)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, parse_set(args.set))
    assert cfg.data.regenerate in ("first_turn", "all_turns"), "data.regenerate is off: nothing to seed"
    tok = load_tokenizer(cfg)
    out = cfg.step_dir("prepare")
    out.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.conversations.suffix == ".gz" else open
    keys, gens = [], []
    by_id = None
    with opener(args.conversations, "rt") as f:
        for line in f:
            rec = json.loads(line)
            if "answers" in rec:  # answers-only: the user turns come from this config's sources
                if by_id is None:
                    by_id = {c["id"]: c["messages"] for c in selected_conversations(cfg)[0]}
                if rec["id"] not in by_id:
                    continue
                answers = iter(rec["answers"])
                msgs = []
                for m in by_id[rec["id"]]:
                    if m["role"] == "assistant":
                        a = next(answers, None)
                        if a is None:
                            break
                        m = {"role": "assistant", "content": a}
                    msgs.append(m)
            else:
                msgs = rec["messages"]
            # round r's prompt is the system turns, the earlier user turns with the target's answers, and user
            # turn r: the exact context prepare builds (its answers are the text kept here)
            history = [m for m in msgs if m["role"] == "system"]
            turns = [m for m in msgs if m["role"] in ("user", "assistant")]
            for r, (user, answer) in enumerate(zip(turns[0::2], turns[1::2])):
                if r and cfg.data.regenerate == "first_turn":
                    break
                ids = tok.encode(answer["content"], add_special_tokens=False)
                keys.append(RegenCache.key(r, prompt_ids(tok, history + [user])))
                gens.append(Generation(answer["content"], ids,
                                       "length" if len(ids) >= cfg.data.max_new_tokens else "stop"))
                history += [user, answer]
    (out / REGEN_CACHE).unlink(missing_ok=True)
    cache = RegenCache(out / REGEN_CACHE)
    cache.add(keys, gens)
    cache.close()
    (out / ".fingerprint").write_text(fingerprint(cfg, "prepare"))
    print(f"[seed] {len(keys)} answers from {args.conversations} -> {out / REGEN_CACHE}")
    return 0


def answers_only(src: Path, out: Path) -> int:
    """CONVERSATIONS -> {"id", "answers"} per conversation (gzip, reproducible bytes)."""
    opener = gzip.open if src.suffix == ".gz" else open
    lines = []
    with opener(src, "rt") as f:
        for line in f:
            rec = json.loads(line)
            answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
            lines.append(json.dumps({"id": rec["id"], "answers": answers}, ensure_ascii=False))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), compresslevel=9, mtime=0))
    print(f"[seed] {len(lines)} conversations' answers -> {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
