"""`data.seed_answers`: answers of an earlier regeneration that `prepare` reuses instead of generating them again.

The file is an earlier run's `prepare/conversations.jsonl` (plain, gzip or xz) or the answers-only form
`{"id", "answers": [...]}` per conversation that `tests/bench/h200/seed_regen_cache.py --answers-only` writes
(data/seeds/ keeps one: the target's answers without the prompts). An answer is reused only for the exact prompt it
answered: the same conversation id, the same system and user turns up to its round (an answers-only file takes
them from this run's own sources), and the same earlier answers. Anything else is generated, and a conversation
whose earlier answer was generated here gets no seeded answer after it. Prepare counts them (`seeded_answers`).

Like an interrupted run's resume cache, a seed saves generating and is not in prepare's fingerprint: its answers are
the same target's greedy answers (made on another machine, they can differ after a near-tie: NOTES "Session 29").
A seed's `.json` record beside it (same name, `.json` for `.jsonl[.gz|.xz]`), where there is one, must name the same
source files (sha256) and the same `max_new_tokens` and `temperature`, or the seed is refused.
"""
from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

from .config import Config
from .manifest import StepError, sha256_file


def open_text(path: Path):
    """gzip, xz or plain text, by the bytes, not the name."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:2] == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    if head == b"\xfd7zXZ\x00":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def sidecar(seed: Path) -> Path:
    return seed.with_name(seed.name.removesuffix(".gz").removesuffix(".xz").removesuffix(".jsonl") + ".json")


def sidecar_problems(seed: Path, cfg: Config) -> list[str] | None:
    """Why the seed's .json record says it was made for other sources or settings ([] if it fits), None if it has
    no record."""
    from .prepare import source_tags

    side = sidecar(seed)
    if not side.exists():
        return None
    made = json.loads(side.read_text())
    problems = []
    recorded = {x["tag"]: x["sha256"] for x in made.get("sources", [])}
    sources = cfg.data.sources or [cfg.data.path]
    for tag, path in zip(source_tags(sources), sources):
        if tag in recorded and path and cfg.path(path).exists() and sha256_file(cfg.path(path)) != recorded[tag]:
            problems.append(f"source {path} is not the file the answers were made from (sha256 {recorded[tag][:12]}...)")
    for key in ("max_new_tokens", "temperature"):
        want = made.get("settings", {}).get(key)
        if want is not None and getattr(cfg.data, key) != want:
            problems.append(f"data.{key} = {getattr(cfg.data, key)}, the seed was made with {want}")
    return problems


def seed_path(cfg: Config) -> Path | None:
    """data.seed_answers resolved, checked before prepare touches its folder; None when unset."""
    if not cfg.data.seed_answers:
        return None
    path = cfg.path(cfg.data.seed_answers)
    fix = f"Fix data.seed_answers in {cfg.source_path}, or set it to \"\" to generate every answer"
    if cfg.data.regenerate == "off":
        raise StepError(f"data.seed_answers = {cfg.data.seed_answers!r} but data.regenerate = \"off\": nothing is "
                        f"generated, so nothing can be seeded. {fix}")
    if not path.is_file():
        raise StepError(f"data.seed_answers: {path} does not exist. {fix}")
    problems = sidecar_problems(path, cfg)
    if problems:
        raise StepError(f"data.seed_answers: {path} does not fit this run ({sidecar(path).name}): "
                        + "; ".join(problems) + f". {fix}")
    return path


def load(path: Path, ids: set[str]) -> dict[str, dict]:
    """The seed's conversations among `ids`: id -> {"system": [...] or None, "users": [...] or None, "answers": [...]}
    (None: an answers-only record, whose turns are this run's own)."""
    seed = {}
    with open_text(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["id"] not in ids:
                continue
            if "answers" in rec:
                seed[rec["id"]] = {"system": None, "users": None, "answers": rec["answers"]}
            else:
                msgs = rec["messages"]
                seed[rec["id"]] = {"system": [m["content"] for m in msgs if m["role"] == "system"],
                                   "users": [m["content"] for m in msgs if m["role"] == "user"],
                                   "answers": [m["content"] for m in msgs if m["role"] == "assistant"]}
    return seed


def answer(seed: dict[str, dict], cid: str, round_: int, history: list[dict], user: dict) -> str | None:
    """The seeded answer to round `round_` of conversation `cid`, whose context so far is `history` (system turns,
    then user and assistant turns) and whose next user turn is `user`, or None where the seed did not answer this
    very prompt."""
    s = seed.get(cid)
    if s is None or round_ >= len(s["answers"]):
        return None
    answers = [m["content"] for m in history if m["role"] == "assistant"]
    if answers != s["answers"][:round_]:
        return None
    if s["users"] is not None:
        users = [m["content"] for m in history if m["role"] == "user"] + [user["content"]]
        system = [m["content"] for m in history if m["role"] == "system"]
        if users != s["users"][:round_ + 1] or system != s["system"]:
            return None
    return s["answers"][round_]
