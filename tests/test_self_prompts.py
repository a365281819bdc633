"""pipeline.self_prompts: requests the target writes itself (Magpie), through the real SmolLM2 on CPU."""
from __future__ import annotations

import gzip
import json

import pytest
from conftest import write_config

from pipeline import self_prompts
from pipeline.config import load_config
from pipeline.datasets import load_mtbench
from pipeline.manifest import StepError
from pipeline.prepare import load_tokenizer, selected_conversations
from pipeline.prompt_sets import PLACEHOLDER


@pytest.fixture(scope="module")
def cfg(smollm2, tmp_path_factory):
    work = tmp_path_factory.mktemp("self-prompts")
    return load_config(write_config(work / "sp.toml", work / "runs", "sp"))


def test_counts_cover_n_and_follow_the_shares():
    shares = [share for _, share, _ in self_prompts.CATEGORIES]
    for n in (1, 7, 24, 1000, 24001):
        c = self_prompts.counts(n)
        assert sum(c) == n
        assert all(abs(k - n * share) < 1 for k, share in zip(c, shares)), (n, c)
    assert self_prompts.counts(1) == [1] + [0] * 10
    assert self_prompts.counts(1000) == [400] + [75] * 8 + [0, 0]
    # the two task categories (session 31) are off unless --shares names them: files written before them come
    # out the same again (same counts, same request order, same per-request seeds)
    assert [name for name, _, _ in self_prompts.CATEGORIES][-2:] == ["writing_task", "explain_task"]
    only_tasks = {name: 0 for name, _, _ in self_prompts.CATEGORIES} | {"writing_task": 1, "explain_task": 1}
    assert self_prompts.counts(11, only_tasks) == [0] * 9 + [6, 5]


def test_shares_move_requests_between_categories_and_bad_ones_are_refused():
    names = [name for name, _, _ in self_prompts.CATEGORIES]
    shares = self_prompts.parse_shares("writing=0.15, science=0")
    assert shares == {"writing": 0.15, "science": 0.0}  # the sum stays 1 here
    c = dict(zip(names, self_prompts.counts(1000, shares)))
    assert c == {**c, "default": 400, "writing": 150, "science": 0, "math": 75} and sum(c.values()) == 1000
    # shares are relative: doubling every one changes nothing
    assert self_prompts.counts(999, {n: 2 * s for n, s, _ in self_prompts.CATEGORIES}) == self_prompts.counts(999)
    assert self_prompts.parse_shares("") == {}
    for bad in ("poetry=0.2", "writing=-1", "writing", "writing=lots", "writing=nan", "writing=inf"):
        with pytest.raises(StepError, match="the categories are default, writing"):
            self_prompts.parse_shares(bad)
    with pytest.raises(StepError, match="every category at 0"):
        self_prompts.counts(10, {n: 0 for n in names})


def test_request_prefix_is_the_opening_of_a_user_turn(cfg):
    tok = load_tokenizer(cfg)
    for system in (None, "You are a math tutor."):
        prefix = self_prompts.request_prefix(tok, system)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi there"}]
        full = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
        assert full[: len(prefix)] == prefix, system
        rest = tok.decode(full[len(prefix):])
        assert rest.startswith("Hi there"), rest   # the prefix ends where the request's text begins
    # SmolLM2's template puts its default system turn in when there is none: the stored conversation (no system
    # turn) is regenerated under exactly the context the "default" requests were written in
    assert "SmolLM" in tok.decode(self_prompts.request_prefix(tok, None))
    # an opening (OPENINGS) is the request's first words: the same template, then the opening's tokens
    bare, opened = self_prompts.request_prefix(tok, None), self_prompts.request_prefix(tok, None, "Write a poem")
    assert opened[: len(bare)] == bare and tok.decode(opened[len(bare):]) == "Write a poem"


def test_select_drops_each_reason_and_keeps_the_rest():
    q = load_mtbench("vllm-0.32")[0]["turns"][0]
    gens = [("default", "  Can you plan a three-day trip to Lisbon for me?  ", "stop", False),
            ("default", "Can you plan a three-day   trip to LISBON for me?", "stop", False),   # duplicate, normalised
            ("math", "What is 17 times 23, step by step?", "length", False),                 # cut at the token cap
            ("coding", "Hi!", "stop", False),                                               # too short
            ("writing", q, "stop", False),                                                  # MT-bench itself
            ("reasoning", "Which is heavier, a kilo of iron or of feathers? assistant\nThe same.", "stop", True),
            ("science", "Why is the sky blue during the day but red at sunset?", "stop", False)]
    kept, dropped = self_prompts.select(gens, [q])
    assert [r["conversations"][0]["value"] for r in kept] == [
        "Can you plan a three-day trip to Lisbon for me?", "Why is the sky blue during the day but red at sunset?"]
    assert [r["id"] for r in kept] == ["default-000000", "science-000006"]
    assert all(r["conversations"][1] == {"from": "gpt", "value": PLACEHOLDER} for r in kept)
    assert dropped == {"duplicate": 1, "unfinished (hit --max-new-tokens)": 1,
                       f"shorter than {self_prompts.MIN_CHARS} characters": 1, "MT-bench near-duplicate": 1,
                       "special token before the end of the request": 1}


def test_build_writes_a_source_prepare_takes_and_is_reproducible(cfg, tmp_path):
    """The real target writes the requests (CPU, transformers); the same seed gives the same bytes, another seed
    other bytes; prepare selects every kept request as a conversation of a mix's source."""
    out = tmp_path / "self.jsonl.gz"
    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    kw = dict(temperature=0.9, max_new_tokens=48, batch_size=16, seed=3, progress=False)
    side = self_prompts.build(cfg, 16, out, questions, **kw)
    recs = [json.loads(line) for line in gzip.open(out, "rt")]
    assert side["asked"] == 16 and side["conversations"] == len(recs) == 16 - side["dropped_total"]
    assert len(recs) >= 4, side["dropped"]   # SmolLM2 ends most requests well inside 48 tokens
    assert sum(c["kept"] for c in side["categories"].values()) == len(recs)
    assert all(r["conversations"][0]["from"] == "human" and r["conversations"][1]["value"] == PLACEHOLDER for r in recs)
    first = out.read_bytes()
    again = self_prompts.build(cfg, 16, out, questions, **kw)
    assert out.read_bytes() == first and again["output_sha256"] == side["output_sha256"]
    assert [c["share"] for c in side["categories"].values()] == pytest.approx(self_prompts.category_shares(), abs=1e-6)
    other = self_prompts.build(cfg, 16, tmp_path / "other.jsonl.gz", questions, **{**kw, "seed": 4},
                               shares={"writing": 0.925})   # as much as the others' 0.925 together: half
    assert other["output_sha256"] != side["output_sha256"]
    assert other["categories"]["writing"]["share"] == 0.5 and other["categories"]["writing"]["asked"] == 8

    mix = load_config(cfg.source_path, {"data.sources": ["sharegpt", str(out)], "data.weights": [0.001, 1.0],
                                        "data.max_conversations": 0, "data.regenerate": "first_turn"})
    selected, report, _ = selected_conversations(mix)
    mine = [c for c in selected if c["id"].startswith("self/")]
    assert len(mine) == len(recs)
    assert {c["messages"][0]["content"] for c in mine} == {r["conversations"][0]["value"] for r in recs}


def test_task_categories_open_each_request_with_their_openings(cfg, tmp_path):
    """writing_task / explain_task (session 31): the real target continues each opening in turn; the stored
    request starts with it (the target's own requests almost never open with a task verb: NOTES "Session 31")."""
    out = tmp_path / "tasks.jsonl.gz"
    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    only = {name: 0 for name, _, _ in self_prompts.CATEGORIES} | {"writing_task": 1, "explain_task": 1}
    side = self_prompts.build(cfg, 16, out, questions, temperature=0.9, max_new_tokens=48, batch_size=16, seed=3,
                              progress=False, shares=only)
    recs = [json.loads(line) for line in gzip.open(out, "rt")]
    assert len(recs) >= 8, side["dropped"]
    for r in recs:
        cat, i = r["set"], int(r["id"].rsplit("-", 1)[1])   # ids count over all requests: explain's start at 8
        first = self_prompts.OPENINGS[cat][(i - (8 if cat == "explain_task" else 0)) % len(self_prompts.OPENINGS[cat])]
        text = r["conversations"][0]["value"]
        assert text.startswith(first) and len(text) > len(first) + 3, (first, text)
    assert side["categories"]["writing_task"]["openings"] == list(self_prompts.OPENINGS["writing_task"])
    assert "openings" not in side["categories"]["default"]


def test_vllm_engine_gives_each_request_its_own_seed_and_the_same_file_again(cfg, tmp_path, monkeypatch):
    """`--engine vllm` (real vLLM on CPU): one seed per request, so the 24 requests are not one per category (one
    seed for all would write the same request for every prompt of a category, and select drops those as
    duplicates); the same seed writes the same bytes again, and another seed other requests (session 48's
    `(seed << 32) | i` lost the seed in torch's 32-bit CPU generator: set 18 repeated set 15's requests)."""
    out, other = tmp_path / "self.jsonl.gz", tmp_path / "other.jsonl.gz"
    questions = [t for q in load_mtbench("vllm-0.32") for t in q["turns"]]
    kw = dict(temperature=0.9, max_new_tokens=64, batch_size=0, progress=False, engine="vllm")
    side = self_prompts.build(cfg, 24, out, questions, seed=3, **kw)
    recs = [json.loads(line) for line in gzip.open(out, "rt")]
    assert side["sampling"]["engine"].startswith("vLLM") and side["sampling"]["vllm"]
    assert len(recs) > len(self_prompts.CATEGORIES), side["dropped"]
    first = out.read_bytes()
    self_prompts.build(cfg, 24, out, questions, seed=3, **kw)
    assert out.read_bytes() == first
    self_prompts.build(cfg, 24, other, questions, seed=4, **kw)
    texts = [{r["conversations"][0]["value"] for r in map(json.loads, gzip.open(f, "rt"))} for f in (out, other)]
    assert len(texts[1]) > len(self_prompts.CATEGORIES) and len(texts[0] & texts[1]) <= 2, texts[0] & texts[1]
    assert self_prompts.request_seed(3, 5) != self_prompts.request_seed(4, 5) != self_prompts.request_seed(3, 6)
    assert self_prompts.request_seed(255, 2**24 - 1) == 2**32 - 1
    for seed, i in ((256, 0), (3, 2**24), (-1, 0)):
        with pytest.raises(StepError, match="seed in 0..255"):
            self_prompts.request_seed(seed, i)
    monkeypatch.setattr(self_prompts, "write_requests", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(StepError, match="seed in 0..255"):   # refused before the model loads
        self_prompts.build(cfg, 24, tmp_path / "refused.jsonl.gz", questions, seed=256, **kw)


def test_per_request_seeds_must_match_the_prompts():
    from pipeline.engines.vllm_offline import generate

    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        generate(object(), [[1, 2]], max_new_tokens=4, temperature=1.0, seed=[1, 2])
    with pytest.raises(StepError, match="use hf .transformers. or vllm"):
        self_prompts.write_requests(None, [[1]], engine="tgi", temperature=1.0, max_new_tokens=4, batch_size=1,
                                    seed=0, progress=False)
