"""Seed a run's `prepare` with the answers of an earlier regeneration, to save device time.

    python tests/bench/h200/seed_regen_cache.py --config C [--set k=v ...] CONVERSATIONS.jsonl[.gz]
    python tests/bench/h200/seed_regen_cache.py --answers-only CONVERSATIONS.jsonl[.gz|.xz] [MORE ...] OUT.jsonl.xz

CONVERSATIONS is an earlier run's `prepare/conversations.jsonl` (same target, greedy; first-turn or all-turn
regeneration, as data.regenerate says: all turns are seeded round by round, each with the earlier answers in context),
or the answers-only form that `--answers-only` writes from one: `{"id", "answers": [...]}` per conversation, the
target's answers without the prompts (so the repository can keep a seed without redistributing the prompt sets:
data/seeds/). Seeding from that form takes the user turns from the config's own sources, by conversation id.
Inputs are read as gzip, xz or plain text by their first bytes; OUT is written as xz when its name ends in .xz (the
seed in data/seeds/ since session 36: half gzip's size, and every device call carries the tree), else as gzip.
Run it after the `model` step: it writes prepare's resume cache (`regenerated.partial.jsonl`) and the folder's
fingerprint, so the next `prepare` treats those answers as finished work of an interrupted run. Answers are keyed
by the exact prompt token ids (a prompt that differs in any token is regenerated), and prepare's manifest counts
them (`reused_from_interrupted_run`). The earlier run kept only the text: token ids are the text re-encoded and
`finish_reason` is "length" where that has data.max_new_tokens tokens, so the truncation count is approximate.
"""

import argparse
import gzip
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pipeline.env import setup_env  # noqa: E402

setup_env()  # caches inside the repo, before torch and transformers are imported
from pipeline.__main__ import parse_set  # noqa: E402
from pipeline.chat import prompt_ids_batch  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.engines.vllm_offline import Generation  # noqa: E402
from pipeline.prepare import REGEN_CACHE, RegenCache, load_tokenizer, selected_conversations  # noqa: E402
from pipeline.seed_answers import open_text, sidecar, sidecar_problems  # noqa: E402
from pipeline.steps import fingerprint  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] == ["--answers-only"] and len(argv) >= 3:
        return answers_only([Path(a) for a in argv[1:-1]], Path(argv[-1]))
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
    rounds, prompts, answers = [], [], []
    by_id, unmatched = None, 0
    with open_text(args.conversations) as f:
        for line in f:
            rec = json.loads(line)
            if "answers" in rec:  # answers-only: the user turns come from this config's sources
                if by_id is None:
                    check_sidecar(args.conversations, cfg)
                    by_id = {c["id"]: c["messages"] for c in selected_conversations(cfg)[0]}
                if rec["id"] not in by_id:
                    unmatched += 1
                    continue
                # as prepare regenerates: the system turns, then user turn r with answer r (tool turns flattened)
                conv = by_id[rec["id"]]
                msgs = [m for m in conv if m["role"] == "system"]
                for user, answer in zip([m for m in conv if m["role"] == "user"], rec["answers"]):
                    msgs += [user, {"role": "assistant", "content": answer}]
            else:
                msgs = rec["messages"]
            # round r's prompt is the system turns, the earlier user turns with the target's answers, and user
            # turn r: the exact context prepare builds (its answers are the text kept here)
            history = [m for m in msgs if m["role"] == "system"]
            turns = [m for m in msgs if m["role"] in ("user", "assistant")]
            for r, (user, answer) in enumerate(zip(turns[0::2], turns[1::2])):
                if r and cfg.data.regenerate == "first_turn":
                    break
                rounds.append(r)
                prompts.append(history + [user])
                answers.append(answer["content"])
                history += [user, answer]
    # tokenized in two batched calls (the whole script took ~105 s for 53k rounds on the H200, tokenizing one by one)
    answer_ids = tok(answers, add_special_tokens=False)["input_ids"] if answers else []
    keys = [RegenCache.key(r, p) for r, p in zip(rounds, prompt_ids_batch(tok, prompts))]
    gens = [Generation(text, ids, "length" if len(ids) >= cfg.data.max_new_tokens else "stop")
            for text, ids in zip(answers, answer_ids)]
    (out / REGEN_CACHE).unlink(missing_ok=True)
    cache = RegenCache(out / REGEN_CACHE)
    cache.add(keys, gens)
    cache.close()
    (out / ".fingerprint").write_text(fingerprint(cfg, "prepare"))
    print(f"[seed] {len(keys)} answers from {args.conversations} -> {out / REGEN_CACHE}"
          + (f"; {unmatched} conversations of the seed are not in this run's selection" if unmatched else ""))
    if by_id is not None and not keys:
        print(f"[seed] nothing seeded: no conversation id of {args.conversations} is in this run's sources "
              f"(a mix's ids are '<source file stem>/<id>')", file=sys.stderr)
        return 1
    return 0


def check_sidecar(seed: Path, cfg) -> None:
    """An answers-only seed is joined to the run's conversations by id: refuse it, naming the file, when its .json
    says it was made from other source files (same tag, other sha256) or with another answer length or sampling."""
    problems = sidecar_problems(seed, cfg)
    if problems is None:
        print(f"[seed] WARNING: no {sidecar(seed).name} beside {seed}: sources and settings not checked", file=sys.stderr)
    elif problems:
        sys.exit(f"[seed] {seed} does not fit this run ({sidecar(seed).name}): " + "; ".join(problems)
                 + ". Run without it (S8_SEED=none) or rebuild the sources it names.")


def answers_only(sources: list[Path], out: Path) -> int:
    """CONVERSATIONS (or answers-only files) -> {"id", "answers"} per conversation (xz or gzip by OUT's name,
    reproducible bytes), in the order first met. Several inputs merge by id, so the seed in data/seeds/ can be one of
    them (it is read whole before OUT is written): a session's new answers are added to it (name the seed first, so
    its order stays). The same id with other answers is refused (greedy answers of the same prompts do not differ:
    something else changed)."""
    merged: dict[str, list[str]] = {}
    for src in sources:
        with open_text(src) as f:
            for line in f:
                rec = json.loads(line)
                answers = rec["answers"] if "answers" in rec else [m["content"] for m in rec["messages"]
                                                                    if m["role"] == "assistant"]
                if merged.setdefault(rec["id"], answers) != answers:
                    sys.exit(f"[seed] {rec['id']}: {src} has other answers than an earlier input; not merged")
    lines = [json.dumps({"id": i, "answers": a}, ensure_ascii=False) for i, a in merged.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ("\n".join(lines) + "\n").encode("utf-8")
    out.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME) if out.name.endswith(".xz")
                    else gzip.compress(text, compresslevel=9, mtime=0))
    print(f"[seed] {len(lines)} conversations' answers -> {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
