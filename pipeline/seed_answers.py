"""`data.seed_answers`: answers of an earlier regeneration that `prepare` reuses instead of generating them again.

Two forms, plain, gzip or xz:
- an earlier run's `prepare/conversations.jsonl` (records with "regenerated": true). An answer is reused for the
  prompt it answered, found by content: the same system turns, the same user turns up to its round and the same
  earlier answers, whatever the conversation's id;
- the answers-only form, `{"id", "answers": [...]}` per conversation, that `tests/bench/h200/seed_regen_cache.py
  --answers-only` writes (data/seeds/ keeps one: the target's answers without the prompts). The prompts are this
  run's own: a conversation's answers are found by its id (a weighted copy "<id>#k" by its original's), and an
  answer is reused while the earlier answers in this run's context are the seed's.
Everything else is generated, and prepare counts what was seeded (`seeded_answers`, with the seed's sha256).

Like an interrupted run's resume cache, a seed saves generating and is not in prepare's fingerprint: it must hold the
same target's greedy answers, which matching by text or id cannot tell. What can be checked is, before prepare
touches its folder: every line is a record of one form (a conversation marked "regenerated"); the seed is not inside
this run's own prepare folder (emptied when prepare runs again); an answers-only seed's `.json` record beside it
(same name, `.json` for `.jsonl[.gz|.xz]`) must name the same source files (sha256) and the same `max_new_tokens`
and `temperature`; a conversations seed's prepare manifest (`manifest.json` beside a `conversations.jsonl`, or
`prepare-manifest.json` beside any name, as the device chain sends one back) must show the same sampling settings
and a regeneration, and a warning says when its target's hash is not this run's (the same weights converted by
another transformers version hash differently) or when there is no record to check.
"""
from __future__ import annotations

import gzip
import json
import lzma
import sys
from pathlib import Path

from .config import Config
from .manifest import StepError, read_manifest, sha256_file


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
    """Why an answers-only seed's .json record says it was made for other sources or settings ([] if it fits), None
    if it has no record."""
    from .prepare import source_tags

    side = sidecar(seed)
    if not side.exists():
        return None
    try:
        made = json.loads(side.read_text())
        recorded = {x["tag"]: x["sha256"] for x in made.get("sources", [])}
        settings = made.get("settings", {})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        return [f"{side} is not a seed's record ({type(e).__name__}: {e})"]
    problems = []
    sources = cfg.data.sources or [cfg.data.path]
    for tag, path in zip(source_tags(sources), sources):
        if tag in recorded and path and cfg.path(path).exists() and sha256_file(cfg.path(path)) != recorded[tag]:
            problems.append(f"source {path} is not the file the answers were made from (sha256 {recorded[tag][:12]}...)")
    return problems + _settings_problems(settings, cfg, "the seed was made with")


def _settings_problems(settings: dict, cfg: Config, had: str) -> list[str]:
    """The sampling settings a seed's record names that are not this run's (they change every answer)."""
    return [f"data.{key} = {getattr(cfg.data, key)}, {had} {settings[key]}" for key in ("max_new_tokens", "temperature")
            if settings.get(key) is not None and settings[key] != getattr(cfg.data, key)]


def _form(path: Path, fix: str) -> str:
    """"answers" or "conversations": the seed's form, after every line is checked to be a record of that one form
    (a conversations.jsonl record must say "regenerated": true: a data file is not a prepare output). Refused, naming
    the line, otherwise; before prepare touches its folder, so a bad seed costs nothing."""
    form = None
    try:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise StepError(f"data.seed_answers: {path} line {n} is not JSON. {fix}") from None
                this = ("answers" if isinstance(rec, dict) and isinstance(rec.get("answers"), list)
                        and isinstance(rec.get("id"), str) else
                        "conversations" if isinstance(rec, dict) and isinstance(rec.get("messages"), list)
                        and isinstance(rec.get("id"), str) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                                   and isinstance(m.get("content"), str)
                                                                   for m in rec["messages"]) else None)
                if this is None:
                    raise StepError(f"data.seed_answers: {path} line {n} is neither an answers-only record "
                                    f"({{\"id\", \"answers\"}}) nor a conversation ({{\"id\", \"messages\"}}). {fix}")
                if this == "conversations" and not rec.get("regenerated"):
                    raise StepError(f"data.seed_answers: {path} line {n}: conversation {rec['id']} was not regenerated "
                                    f"by a target (no \"regenerated\": true): a seed is a prepare output of a run that "
                                    f"regenerated, or an answers-only seed. {fix}")
                if form not in (None, this):
                    raise StepError(f"data.seed_answers: {path} line {n}: a {this} record after {form} records; a "
                                    f"seed holds one form. {fix}")
                form = this
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
        raise StepError(f"data.seed_answers: {path} cannot be read as text, gzip or xz ({type(e).__name__}: {e}). "
                        f"{fix}") from None
    if form is None:
        raise StepError(f"data.seed_answers: {path} is empty. {fix}")
    return form


def run_manifest(path: Path) -> Path | None:
    """The prepare manifest that describes a conversations seed: manifest.json beside a conversations.jsonl (its
    prepare folder), or prepare-manifest.json beside any other name (what the device chain sends back with one)."""
    for candidate in ((path.parent / "manifest.json") if path.name == "conversations.jsonl" else None,
                      path.parent / "prepare-manifest.json"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def _run_manifest_problems(path: Path, cfg: Config) -> list[str] | None:
    """For a conversations seed: what its prepare manifest (run_manifest) contradicts (None: no manifest)."""
    found = run_manifest(path)
    if found is None:
        return None
    try:
        m = json.loads(found.read_text())
        data = m["config_sections"]["data"]
        theirs = m.get("inputs", {}).get("model")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{found} is not a prepare manifest ({type(e).__name__}: {e})"]
    problems = []
    if data.get("regenerate", "off") == "off":
        problems.append(f"its run did not regenerate ({found}: data.regenerate = \"off\"): its answers are not the "
                        f"target's")
    problems += [f"{p} ({found})" for p in _settings_problems(data, cfg, "the seed's run had")]
    ours = read_manifest(cfg.step_dir("model")) or {}
    if theirs and ours.get("outputs_hash") and theirs != ours["outputs_hash"]:
        print(f"[prepare] warning: data.seed_answers: {path}'s run had the target {theirs[:12]}... ({found}), this "
              f"run has {ours['outputs_hash'][:12]}... (another conversion of the same weights, or another target: if "
              f"the target changed, its answers are not this target's; set data.seed_answers = \"\")",
              file=sys.stderr)
    return problems


def seed_path(cfg: Config, check: bool = True) -> Path | None:
    """data.seed_answers resolved and (check) its provenance checked, before prepare touches its folder; None when
    unset."""
    if not cfg.data.seed_answers:
        return None
    path = cfg.path(cfg.data.seed_answers)
    fix = (f"Fix data.seed_answers in {cfg.source_path} (or the --set that gives it), or set it to \"\" to generate "
           f"every answer")
    if cfg.data.regenerate == "off":
        raise StepError(f"data.seed_answers = {cfg.data.seed_answers!r} but data.regenerate = \"off\": nothing is "
                        f"generated, so nothing can be seeded. {fix}")
    if not path.is_file():
        raise StepError(f"data.seed_answers: {path} is not a file. {fix}")
    if path.resolve().is_relative_to(cfg.step_dir("prepare").resolve()):
        raise StepError(f"data.seed_answers: {path} is inside this run's own prepare folder, which prepare empties "
                        f"before it runs again; copy the file elsewhere and name the copy. {fix}")
    if not check:
        return path
    if _form(path, fix) == "answers":
        problems = sidecar_problems(path, cfg)
        if problems is None:
            print(f"[prepare] warning: data.seed_answers: no {sidecar(path).name} beside {path}: its sources and "
                  f"settings are not checked", file=sys.stderr)
    else:
        problems = _run_manifest_problems(path, cfg)
        if problems is None:
            print(f"[prepare] warning: data.seed_answers: no prepare manifest (manifest.json beside a "
                  f"conversations.jsonl, or prepare-manifest.json) beside {path}: its run's settings are not checked",
                  file=sys.stderr)
    if problems:
        raise StepError(f"data.seed_answers: {path} does not fit this run: " + "; ".join(problems) + f". {fix}")
    return path


class Seed:
    """The seed's answers: by_id (answers-only records: id -> answers) and by_prompt (conversations.jsonl records:
    (system turns, user turns up to round r, answers before r) -> the answer to round r)."""

    def __init__(self, path: Path, ids: set[str]):
        self.path, self.sha256 = path, sha256_file(path)
        self.by_id: dict[str, list[str]] = {}
        self.by_prompt: dict[tuple, str] = {}
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                rec = json.loads(line)
                if "answers" in rec:  # preflight checked the form of every line (_form)
                    if rec["id"] in ids and self.by_id.setdefault(rec["id"], rec["answers"]) != rec["answers"]:
                        raise StepError(f"data.seed_answers: {path} line {n}: conversation {rec['id']} again, with "
                                        f"other answers; keep one (seed_regen_cache.py --answers-only merges by id)")
                    continue
                msgs = rec["messages"]
                system = tuple(m["content"] for m in msgs if m["role"] == "system")
                users = [m["content"] for m in msgs if m["role"] == "user"]
                answers = [m["content"] for m in msgs if m["role"] == "assistant"]
                for r, a in enumerate(answers[: len(users)]):
                    self.by_prompt.setdefault((system, tuple(users[: r + 1]), tuple(answers[:r])), a)

    def __len__(self) -> int:
        return len(self.by_id) + len(self.by_prompt)

    def answer(self, ids: tuple[str, ...], round_: int, history: list[dict], user: dict) -> str | None:
        """The seeded answer to round `round_` of the conversation known by `ids` (its id, then its original's),
        whose context so far is `history` (system turns, then user and assistant turns) and whose next user turn is
        `user`, or None where the seed did not answer this very prompt."""
        answers = [m["content"] for m in history if m["role"] == "assistant"]
        for cid in ids:
            s = self.by_id.get(cid)
            if s is not None:
                return s[round_] if round_ < len(s) and s[:round_] == answers else None
        if not self.by_prompt:
            return None
        system = tuple(m["content"] for m in history if m["role"] == "system")
        users = tuple(m["content"] for m in history if m["role"] == "user") + (user["content"],)
        return self.by_prompt.get((system, users, tuple(answers)))
