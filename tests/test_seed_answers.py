"""data.seed_answers (pipeline/seed_answers.py): which prompts a seed answers, and the refusals that come before
prepare touches its folder. No model: prepare's own use of a seed runs through the hf engine in
tests/test_hf_engines.py (test_all_turn_regeneration_keeps_the_context_and_seeds_exactly)."""
from __future__ import annotations

import gzip
import json

import pytest

from pipeline.manifest import StepError
from pipeline.seed_answers import Seed, seed_path


def _lines(path, recs) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _turns(system, pairs) -> list[dict]:
    out = [{"role": "system", "content": s} for s in system]
    for u, a in pairs:
        out += [{"role": "user", "content": u}] + ([{"role": "assistant", "content": a}] if a is not None else [])
    return out


def test_a_seed_answers_only_the_prompts_it_answered(work):
    # answers-only: by id, or a weighted copy's original; while the earlier answers in the context are the seed's
    only = work / "answers.jsonl"
    _lines(only, [{"id": "s/1", "answers": ["A1", "A2"]}])
    seed = Seed(only, {"s/1"})
    ctx = _turns(["sys"], [("q1", "A1")])
    assert seed.answer(("s/1", "s/1"), 0, _turns(["sys"], []), {"content": "q1"}) == "A1"
    assert seed.answer(("s/1", "s/1"), 1, ctx, {"content": "q2"}) == "A2"
    assert seed.answer(("s/1#1", "s/1"), 1, ctx, {"content": "q2"}) == "A2"  # a copy, by its original
    assert seed.answer(("s/1", "s/1"), 1, _turns(["sys"], [("q1", "other")]), {"content": "q2"}) is None
    assert seed.answer(("s/1", "s/1"), 2, ctx + _turns([], [("q2", "A2")]), {"content": "q3"}) is None  # past its end
    assert seed.answer(("s/2", "s/2"), 0, [], {"content": "q1"}) is None
    assert Seed(only, {"s/9"}).by_id == {}  # only the run's conversations are kept

    # a prepare's conversations: by the prompt's text (system, user turns so far, earlier answers), whatever the id
    convs = work / "conversations.jsonl.gz"
    convs.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in [
        {"id": "old-id", "regenerated": True, "messages": _turns(["sys"], [("q1", "A1"), ("q2", "A2")])}]).encode()))
    seed = Seed(convs, set())
    assert seed.answer(("new-id", "new-id"), 0, _turns(["sys"], []), {"content": "q1"}) == "A1"
    assert seed.answer(("new-id", "new-id"), 1, ctx, {"content": "q2"}) == "A2"
    assert seed.answer(("new-id", "new-id"), 0, _turns([], []), {"content": "q1"}) is None  # no system turn
    assert seed.answer(("new-id", "new-id"), 1, _turns(["sys"], [("q1", "other")]), {"content": "q2"}) is None
    assert seed.answer(("new-id", "new-id"), 1, _turns(["sys"], [("q0", "A1")]), {"content": "q2"}) is None


def test_a_bad_seed_is_refused_before_prepare_runs(work, runs_dir):
    from pipeline.config import load_config
    from tests.conftest import write_config

    def cfg_with(seed, **data):
        path = write_config(work / "seeded.toml", runs_dir, "seeded",
                            data={"regenerate": "first_turn", "seed_answers": str(seed), **data})
        return load_config(path)

    def refused(seed, pattern, **data) -> None:
        with pytest.raises(StepError, match=pattern) as e:
            seed_path(cfg_with(seed, **data))
        assert "seeded.toml" in str(e.value) and str(seed.name) in str(e.value)  # the config and the file

    good = work / "good.jsonl"
    _lines(good, [{"id": "s/1", "answers": ["A1"]}])
    assert seed_path(cfg_with(good)) == good
    refused(work / "missing.jsonl", r"is not a file")
    refused(good, r"data\.regenerate = \"off\"", regenerate="off")
    inside = cfg_with(good).step_dir("prepare")
    inside.mkdir(parents=True, exist_ok=True)
    (inside / "conversations.jsonl").write_text(good.read_text())
    refused(inside / "conversations.jsonl", r"inside this run's own prepare folder")
    binary = work / "binary.jsonl.xz"
    binary.write_bytes(b"\xfd7zXZ\x00" + bytes(range(256)))
    refused(binary, r"cannot be read as text, gzip or xz")
    bad_line = work / "bad-line.jsonl"
    bad_line.write_text(json.dumps({"id": "s/1", "answers": ["A1"]}) + "\n{not json\n")
    refused(bad_line, r"line 2 is not JSON")
    mixed = work / "mixed.jsonl"
    _lines(mixed, [{"id": "s/1", "answers": ["A1"]},
                   {"id": "s/2", "regenerated": True, "messages": _turns([], [("q", "a")])}])
    refused(mixed, r"line 2: a conversations record after answers records")
    raw = work / "raw.jsonl"
    _lines(raw, [{"id": "s/1", "messages": _turns([], [("q", "a")])}])
    refused(raw, r"line 1: conversation s/1 was not regenerated")
    shapeless = work / "shapeless.jsonl"
    _lines(shapeless, [[1, 2]])
    refused(shapeless, r"line 1 is neither an answers-only record")
    empty = work / "empty.jsonl"
    empty.write_text("")
    refused(empty, r"is empty")

    # a conversations seed's prepare manifest (as the device chain sends one back) is held to this run's settings
    convs = work / "regenerated-conversations.jsonl"
    _lines(convs, [{"id": "s/1", "regenerated": True, "messages": _turns([], [("q", "a")])}])
    assert seed_path(cfg_with(convs)) == convs  # no manifest: a warning only
    manifest = work / "prepare-manifest.json"
    settings = {"regenerate": "first_turn", "temperature": 0.0, "max_new_tokens": 64}
    manifest.write_text(json.dumps({"config_sections": {"data": settings}, "inputs": {}}))
    assert seed_path(cfg_with(convs, max_new_tokens=64)) == convs
    refused(convs, r"data\.max_new_tokens = 32, the seed's run had 64", max_new_tokens=32)
    manifest.write_text(json.dumps({"config_sections": {"data": {**settings, "regenerate": "off"}}, "inputs": {}}))
    refused(convs, r"its run did not regenerate", max_new_tokens=64)
