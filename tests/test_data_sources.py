"""data.sources / data.weights (issue 15): several conversation sources mixed with weights, de-duplicated across
sources, decontaminated against MT-bench as a whole, recorded per source. Small synthetic JSONL files; no vLLM."""
from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from pipeline.config import ConfigError, load_config, repo_relative
from pipeline.prepare import selected_conversations
from tests.conftest import write_config

TOPICS = ["rivers", "violins", "glaciers", "compilers", "bread", "comets", "orchids", "bridges", "lichens", "tides"]


def conv(i: int, word: str, answer: str = "Here is a careful answer.") -> dict:
    question = f"Tell me curious fact number {i} about {word} and explain why {word} behave that way."
    return {"id": str(i), "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def write_jsonl(path, records, gz: bool = False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes(gzip.compress(text.encode())) if gz else path.write_text(text)
    return path


def mixed_config(work, sources, weights, name="mix", **data):
    d = {"sources": [str(s) for s in sources], "weights": weights, "max_conversations": 0, "eval_fraction": 0.3,
         "regenerate": "off", **data}
    return load_config(write_config(work / f"{name}.toml", work / "runs", name, data=d))


def first_user(c):
    return next(m["content"] for m in c["messages"] if m["role"] == "user")


def by_tag(report):
    return {s["tag"]: s for s in report.sources}


def test_weights_one_and_a_half_give_the_expected_counts(work):
    a = write_jsonl(work / "alpha.jsonl", [conv(i, "rivers") for i in range(20)])
    b = write_jsonl(work / "beta.jsonl.gz", [conv(i, "violins") for i in range(30)], gz=True)
    cfg = mixed_config(work, [a, b], [1.0, 0.5])
    selected, report, contaminated = selected_conversations(cfg)
    assert Counter(c["source"] for c in selected) == {"alpha": 20, "beta": 15}
    assert len({c["id"] for c in selected}) == 35
    assert all(c["id"].startswith(c["source"] + "/") for c in selected)
    s = by_tag(report)
    assert s["alpha"]["records_read"] == 20 and s["beta"]["records_read"] == 30
    assert s["beta"]["usable_conversations"] == 30 and s["beta"]["weighted_conversations"] == 15
    assert s["beta"]["selected"] == 15 == s["beta"]["selected_train"] + s["beta"]["selected_eval"]
    assert s["beta"]["path"] == repo_relative(b) and s["beta"]["weight"] == 0.5
    import hashlib
    assert s["beta"]["sha256"] == hashlib.sha256(b.read_bytes()).hexdigest()
    assert contaminated == set()
    # deterministic (the held-out split is rebuilt from it), and the half is a seeded subset
    again, _, _ = selected_conversations(cfg)
    assert [(c["id"], c["split"]) for c in again] == [(c["id"], c["split"]) for c in selected]
    other, _, _ = selected_conversations(load_config(cfg.source_path, {"run.seed": 1}))
    assert {c["id"] for c in other if c["source"] == "beta"} != {c["id"] for c in selected if c["source"] == "beta"}
    # max_conversations applies to the weighted mix
    capped, _, _ = selected_conversations(load_config(cfg.source_path, {"data.max_conversations": 10}))
    assert len(capped) == 10 and {c["id"] for c in capped} <= {c["id"] for c in selected}


def test_weight_above_one_repeats_with_distinct_ids_and_no_split_leak(work):
    a = write_jsonl(work / "alpha.jsonl", [conv(i, "glaciers") for i in range(40)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "compilers") for i in range(10)])
    cfg = mixed_config(work, [a, b], [2.5, 1.0], eval_fraction=0.3)
    selected, report, _ = selected_conversations(cfg)
    alpha = [c for c in selected if c["source"] == "alpha"]
    assert len(alpha) == 100 and by_tag(report)["alpha"]["weighted_conversations"] == 100
    assert len({c["id"] for c in selected}) == len(selected)
    per_original = Counter(c.get("origin", c["id"]) for c in alpha)
    assert sorted(Counter(per_original.values()).items()) == [(2, 20), (3, 20)]  # 2 whole copies + half again
    split_of = {c["id"]: c["split"] for c in alpha if "origin" not in c}
    assert all(c["split"] == split_of[c["origin"]] for c in alpha if "origin" in c)
    train = {first_user(c) for c in selected if c["split"] == "train"}
    evals = {first_user(c) for c in selected if c["split"] == "eval"}
    assert train and evals and not train & evals


def test_a_duplicate_across_sources_counts_once(work):
    shared = conv(0, "bread", answer="One answer.")
    a = write_jsonl(work / "alpha.jsonl", [shared, conv(1, "bread"), conv(1, "bread")])  # last: in-source duplicate
    again = {**conv(0, "bread", answer="Another answer from another set."), "id": "x"}
    again["conversations"][0]["value"] = "  " + again["conversations"][0]["value"].replace(" ", "  ") + "\n"
    b = write_jsonl(work / "beta.jsonl", [again, conv(5, "comets")])
    selected, report, _ = selected_conversations(mixed_config(work, [a, b], [1.0, 1.0]))
    assert sorted(c["id"] for c in selected) == ["alpha/0", "alpha/1", "beta/5"]
    s = by_tag(report)
    assert s["alpha"]["duplicates_dropped"] == 1 and s["alpha"]["duplicates_of_earlier_sources"] == 0
    assert s["beta"]["duplicates_of_earlier_sources"] == 1 and s["beta"]["usable_conversations"] == 1
    assert report.dropped["duplicate of an earlier source"] == 1


def test_mtbench_questions_are_removed_from_every_source(work):
    from pipeline.datasets import load_mtbench

    q = load_mtbench("vllm-0.32")[0]["turns"][0]
    a = write_jsonl(work / "alpha.jsonl", [conv(i, "orchids") for i in range(5)])
    leak = {"id": "leak", "conversations": [{"from": "human", "value": "Please: " + q}, {"from": "gpt", "value": "ok"}]}
    b = write_jsonl(work / "beta.jsonl", [conv(i, "bridges") for i in range(5)] + [leak])
    selected, report, contaminated = selected_conversations(mixed_config(work, [a, b], [1.0, 3.0]))
    assert contaminated == {"beta/leak"}
    assert all(q not in first_user(c) for c in selected)
    assert by_tag(report)["beta"]["mtbench_near_duplicates_removed"] == 1
    assert by_tag(report)["beta"]["weighted_conversations"] == 15


def test_packaged_sharegpt_mixes_with_a_file(work):
    a = write_jsonl(work / "sharegpt.jsonl", [conv(i, "lichens") for i in range(10)])  # its tag must not clash
    selected, report, _ = selected_conversations(mixed_config(work, ["sharegpt", a], [0.001, 1.0]))
    s = by_tag(report)
    assert set(s) == {"sharegpt", "sharegpt-2"}
    assert s["sharegpt"]["records_read"] == 17671 and s["sharegpt"]["path"].endswith("ShareGPT_V3_unfiltered_cleaned_split.json")
    n = s["sharegpt"]["usable_conversations"]
    assert Counter(c["source"] for c in selected) == {"sharegpt": round(0.001 * n), "sharegpt-2": 10}


def test_heldout_prompts_come_from_the_mix_deterministically(work):
    from pipeline.evaluate import first_turns

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "tides") for i in range(30)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "rivers") for i in range(30)])
    cfg = load_config(mixed_config(work, [a, b], [1.0, 2.0]).source_path, {"eval.prompts": "heldout"})
    turns = first_turns(cfg)
    assert turns and turns == first_turns(cfg)
    held = {first_user(c) for c in selected_conversations(cfg)[0] if c["split"] == "eval"}
    assert {t[-1]["content"] for t in turns} == held
    assert len(turns) == len(held)  # a repeated copy (weight 2) is not a second eval prompt


def test_heldout_prompts_of_one_source_of_the_mix(work):
    """eval.heldout_source: exactly that source's held-out first turns (e.g. ShareGPT's own, out of a mix); an
    unknown tag names the mix's tags; the key without eval.prompts = "heldout" is refused."""
    from pipeline.evaluate import first_turns
    from pipeline.manifest import StepError

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "tides") for i in range(30)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "rivers") for i in range(30)])
    path = mixed_config(work, [a, b], [1.0, 1.0]).source_path
    both = first_turns(load_config(path, {"eval.prompts": "heldout"}))
    mine = {}
    for tag, word in (("alpha", "tides"), ("beta", "rivers")):
        cfg = load_config(path, {"eval.prompts": "heldout", "eval.heldout_source": tag})
        mine[tag] = [t[-1]["content"] for t in first_turns(cfg)]
        held = [first_user(c) for c in selected_conversations(cfg)[0] if c["split"] == "eval" and c["source"] == tag]
        assert mine[tag] and sorted(mine[tag]) == sorted(held) and all(word in q for q in mine[tag])
    assert sorted(mine["alpha"] + mine["beta"]) == sorted(t[-1]["content"] for t in both)
    with pytest.raises(StepError, match=r"'gamma' .* its sources are \['alpha', 'beta'\]"):
        first_turns(load_config(path, {"eval.prompts": "heldout", "eval.heldout_source": "gamma"}))
    with pytest.raises(ConfigError, match='needs eval.prompts = "heldout"'):
        load_config(path, {"eval.heldout_source": "alpha"})


@pytest.mark.parametrize("data, message", [
    ({"weights": [1.0]}, "data.weights has 1 entries but data.sources has 2"),
    ({"weights": [1.0, 0.0]}, "must all be > 0"),
    ({"weights": [1.0, -2.0]}, "must all be > 0"),
    ({"sources": ["sharegpt", "nowhere/missing.jsonl"]}, "'nowhere/missing.jsonl': file not found"),
    ({"path": "x.jsonl"}, "data.path = 'x.jsonl' and data.sources are both set"),
    ({"sources": [], "weights": [1.0]}, "without data.sources"),
    ({"sources": ["sharegpt", ""]}, "lists '' twice"),
])
def test_bad_source_configs_name_the_file_and_the_fix(work, data, message):
    a = write_jsonl(work / "alpha.jsonl", [conv(0, "rivers")])
    d = {"sources": ["sharegpt", str(a)], "weights": [1.0, 0.5], **data}
    p = write_config(work / "bad.toml", work / "runs", "bad", data=d)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and message in str(e.value)


def test_good_source_config_loads_with_integer_weights(work):
    a = write_jsonl(work / "alpha.jsonl", [conv(0, "rivers")])
    cfg = mixed_config(work, ["sharegpt", a], [1, 2])
    assert cfg.data.weights == [1.0, 2.0] and all(isinstance(w, float) for w in cfg.data.weights)


# section_hash("run", "data") of the shipped configs, computed on 999086f (before data.sources existed): the prepare
# fingerprint of every existing single-source run must stay what it was.
BEFORE = {"smollm2-cpu": "ab38b376a48e3016", "smollm2-quality": "578a41ba5110146c", "smollm2-cpu-tiny": "8c454661f93a6bbf"}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_single_path_configs_keep_their_prepare_fingerprint(repo, name):
    cfg = load_config(repo / "configs" / f"{name}.toml")
    assert cfg.data.sources == [] and cfg.section_hash("run", "data") == BEFORE[name]
    mixed = load_config(repo / "configs" / f"{name}.toml", {"data.sources": ["sharegpt"]})
    assert mixed.section_hash("run", "data") != BEFORE[name]


def test_mixed_example_config_loads(repo, work):
    import tomllib

    raw = tomllib.loads((repo / "configs" / "smollm2-mixed-example.toml").read_text())
    assert raw["data"]["sources"][0] == "sharegpt" and len(raw["data"]["weights"]) == len(raw["data"]["sources"])
    user_file = write_jsonl(work / "mine.jsonl", [conv(0, "rivers")])
    cfg = load_config(repo / "configs" / "smollm2-mixed-example.toml",
                      {"data.sources": ["sharegpt", str(user_file)]})
    assert len(cfg.data.sources) == 2


def test_prepare_summary_records_every_source(work, smollm2):
    """prepare itself (regenerate off: no engine) writes the per-source summary and source-tagged samples."""
    from pipeline import prepare

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "comets") for i in range(12)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "orchids") for i in range(12)])
    cfg = mixed_config(work, [a, b], [1.0, 0.5], eval_fraction=0.25)
    out = work / "prepare"
    out.mkdir()
    s = prepare.run(cfg, out)["summary"]
    src = {x["tag"]: x for x in s["sources"]}
    assert src["alpha"]["selected"] == 12 and src["beta"]["selected"] == 6 and s["selected"] == 18
    for x in src.values():
        assert x["train_samples"] + x["eval_samples"] == x["selected"]
        assert x["eval_samples"] == x["selected_eval"]
        assert {"path", "sha256", "records_read", "duplicates_dropped", "mtbench_near_duplicates_removed",
                "weight"} <= set(x)
    assert s["train_samples"] == sum(x["train_samples"] for x in src.values())
    assert s["source"] == "alpha x1 + beta x0.5"
    ids = [json.loads(line)["id"] for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 18


def test_a_source_file_changed_in_place_changes_prepares_inputs(work):
    from pipeline.steps import upstream_of

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "dunes") for i in range(5)])
    cfg = mixed_config(work, [a, "sharegpt"], [1.0, 0.1])
    before = upstream_of(cfg, "prepare")
    assert before[0] == ("model",) and before[1]["sources"][1] == "sharegpt"
    write_jsonl(a, [conv(i, "dunes") for i in range(6)])
    assert upstream_of(cfg, "prepare")[1] != before[1]


def test_a_data_path_file_changed_in_place_changes_prepares_inputs(work):
    """A single local file (data.path, the Kimi configs' way in for recorded trajectories): editing it in place
    must not leave prepare "complete for these inputs" on the old conversations."""
    from pipeline import steps
    from pipeline.manifest import StepError
    from pipeline.steps import upstream_of

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "dunes") for i in range(5)])
    cfg = load_config(write_config(work / "one.toml", work / "runs", "one", data={"path": str(a)}))
    before = upstream_of(cfg, "prepare")
    assert before[0] == ("model",) and len(before[1]["path"]) == 64
    write_jsonl(a, [conv(i, "dunes") for i in range(6)])
    assert upstream_of(cfg, "prepare")[1] != before[1]
    done = cfg.step_dir("prepare")  # a finished prepare: a missing file must not empty it for a new fingerprint
    done.mkdir(parents=True)
    (done / "manifest.json").write_text("{}")
    a.unlink()
    with pytest.raises(StepError, match=r"data.path: conversations file not found: .*alpha.jsonl.*Restore the file"):
        steps.run(cfg, "prepare")
    assert (done / "manifest.json").read_text() == "{}"
    packaged = load_config(write_config(work / "packaged.toml", work / "runs", "packaged"))
    assert upstream_of(packaged, "prepare") == (("model",), {})  # the packaged file is pinned: nothing to hash


def test_prompt_only_sources_are_refused_without_regeneration(work):
    """A prompt_sets file carries a stand-in answer; training on it with data.regenerate = "off" is refused."""
    from pipeline import prepare
    from pipeline.manifest import StepError
    from pipeline.prompt_sets import PLACEHOLDER

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "comets") for i in range(12)])
    b = write_jsonl(work / "prompts.jsonl", [conv(i, "orchids", answer=PLACEHOLDER) for i in range(12)])
    out = work / "prepare"
    out.mkdir()
    with pytest.raises(StepError, match=r"\['prompts'\] hold prompts without answers"):
        prepare.run(mixed_config(work, [a, b], [1.0, 1.0], eval_fraction=0.25), out)


def test_a_weight_that_rounds_to_nothing_is_refused(work):
    from pipeline.manifest import StepError

    a = write_jsonl(work / "alpha.jsonl", [conv(i, "tides") for i in range(20)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "lichens") for i in range(3)])
    with pytest.raises(StepError, match="rounds to none"):
        selected_conversations(mixed_config(work, [a, b], [1.0, 0.1]))


def test_a_prompt_left_out_by_its_weight_is_kept_from_a_later_source(work):
    a = write_jsonl(work / "alpha.jsonl", [conv(i, "bridges") for i in range(20)])
    b = write_jsonl(work / "beta.jsonl", [conv(i, "bridges") for i in range(20)])  # the same 20 prompts
    selected, report, _ = selected_conversations(mixed_config(work, [a, b], [0.5, 1.0]))
    assert len({first_user(c) for c in selected}) == 20  # alpha's 10 + the 10 it left out, from beta
    assert by_tag(report)["beta"]["duplicates_of_earlier_sources"] == 10
