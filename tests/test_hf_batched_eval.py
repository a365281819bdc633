"""Batched transformers evaluation (hf_spec_eval.decode_batch, request["batch_size"]) against the batch-1
path and against vLLM, on the trained drafter of the `trained_run` fixture (real target, real draft, fp32).

Tolerance: per prompt the outputs must be exactly the batch-1 outputs and vLLM's greedy baseline. The
verified proposals and the counters must equal batch 1's up to ONE argmax flip: a padded batch computes
the same fp32 sums in another order (about 1e-6 relative), which can flip a draft argmax only where its
two best logits tie to that precision; one flip changes one draft's acceptance by at most K tokens and
the steps after it in that prompt, so drafts may move by 2, accepted tokens by K, and at most one prompt's
proposals may differ. On this host none was observed (identical proposals and counters at B = 4 and 8).
The counters must also stay within the 0.05 AL / per-position tolerance of vLLM's (test_hf_engines).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

K_FLIPS = 1  # argmax flips tolerated per comparison (see module doc)


def _stats(k: int) -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * k}


def _al(stats: dict, k: int) -> dict:
    from pipeline.evaluate import spec_metrics

    return spec_metrics(stats, k)


def load_eval(eval_dir, draft_path=None):
    """(request, vLLM trained result, vLLM baseline result, target, draft, stop ids) of an eval step."""
    from transformers import AutoTokenizer

    from pipeline.engines.hf_engine import load_target, stop_token_ids
    from pipeline.engines.hf_spec_eval import Eagle3Draft

    req = json.loads((eval_dir / "trained.request.json").read_text())
    vllm_res = json.loads((eval_dir / "trained.result.json").read_text())
    base = json.loads((eval_dir / "baseline.result.json").read_text())
    target = load_target(req["model"], "float32", dev=torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(req["model"])
    draft = Eagle3Draft(draft_path or req["speculative_config"]["model"], target, torch.float32, torch.device("cpu"))
    return req, vllm_res, base, target, draft, stop_token_ids(req["model"], tok, target)


def run_batch1(target, draft, prompts, k, **kw):
    """decode() prompt by prompt: (outputs, counters, proposals per prompt)."""
    from pipeline.engines.hf_spec_eval import decode

    stats, outs, props = _stats(k), [], []
    for p in prompts:
        props.append([])
        outs.append(decode(target, p, draft=draft, k=k, stats=stats, proposals=props[-1], **kw))
    return outs, stats, props


def run_batched(target, draft, prompts, k, batch, **kw):
    """decode_batch() over consecutive chunks of `batch` prompts: (outputs, counters, proposals)."""
    from pipeline.engines.hf_spec_eval import decode_batch

    stats, outs, props = _stats(k), [], []
    for i in range(0, len(prompts), batch):
        got: list = []
        outs += decode_batch(target, prompts[i: i + batch], draft=draft, k=k, stats=stats, proposals=got, **kw)
        props += got
    return outs, stats, props


def assert_counters_close(mine: dict, ref: dict, k: int, flips: int = K_FLIPS) -> None:
    """Counters equal up to `flips` draft argmax flips (module doc)."""
    assert abs(mine["drafts"] - ref["drafts"]) <= 2 * flips, (mine, ref)
    assert abs(mine["draft_tokens"] - ref["draft_tokens"]) <= 2 * k * flips, (mine, ref)
    assert abs(mine["accepted_tokens"] - ref["accepted_tokens"]) <= k * flips, (mine, ref)
    for a, b in zip(mine["accepted_per_pos"], ref["accepted_per_pos"]):
        assert abs(a - b) <= 2 * flips, (mine, ref)


def assert_proposals_close(mine: list, ref: list, flips: int = K_FLIPS) -> None:
    differ = [i for i, (a, b) in enumerate(zip(mine, ref)) if a != b]
    assert len(mine) == len(ref) and len(differ) <= flips, f"proposals differ in prompts {differ}"


@pytest.fixture(scope="module")
def hf(trained_run):
    """The trained drafter's eval request, vLLM's results and the batch-1 hf decode of it (once)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as hf_spec_eval.main: small ops, 2 busy cores
    try:
        req, vllm_res, base, target, draft, stop = load_eval(trained_run.step_dir("eval"))
        k = req["speculative_config"]["num_speculative_tokens"]
        kw = dict(max_tokens=req["max_tokens"], max_model_len=req["max_model_len"], stop=stop)
        outs, stats, props = run_batch1(target, draft, req["prompts"], k, **kw)
        yield dict(req=req, vllm=vllm_res, base=base, target=target, draft=draft, stop=stop, k=k, kw=kw,
                   outs=outs, stats=stats, props=props)
    finally:
        torch.set_num_threads(threads)


def check_batched_spec(hf, batch: int) -> dict:
    """The batched spec-decode checks of one batch size; returns the batched counters."""
    req, k = hf["req"], hf["k"]
    assert len({len(p) for p in req["prompts"][:batch]}) > 1  # ragged prompts: left padding is exercised
    outs, stats, props = run_batched(hf["target"], hf["draft"], req["prompts"], k, batch, **hf["kw"])
    assert hf["outs"] == hf["base"]["outputs"]  # the batch-1 reference itself is exact greedy
    assert outs == hf["outs"]  # per prompt exactly batch 1's (and so vLLM's greedy) output
    assert_proposals_close(props, hf["props"])
    assert_counters_close(stats, hf["stats"], k)
    assert stats["drafts"] == sum(map(len, props)) and stats["draft_tokens"] == sum(len(p) for q in props for p in q)
    mine, theirs = _al(stats, k), _al(hf["vllm"]["spec_decode"], k)
    print(f"batch {batch}: hf {stats} (AL {mine['acceptance_length']:.4f}) vs batch-1 hf {hf['stats']} vs vLLM "
          f"{hf['vllm']['spec_decode']} (AL {theirs['acceptance_length']:.4f})")
    assert mine["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=0.05)
    for a, b in zip(mine["per_position_acceptance"], theirs["per_position_acceptance"]):
        assert a == pytest.approx(b, abs=0.05)
    return stats


def test_batched_spec_decode_all_prompts(hf):
    """All 8 prompts (lengths 50-90) in one batch: batch-1 outputs, proposals and counters."""
    check_batched_spec(hf, len(hf["req"]["prompts"]))


def test_batched_no_draft_is_greedy(hf):
    """The plain (no draft) batched path: vLLM's greedy baseline, no counters touched."""
    from pipeline.engines.hf_spec_eval import decode_batch

    stats = _stats(0)
    outs = decode_batch(hf["target"], hf["req"]["prompts"], stats=stats, **hf["kw"])
    assert outs == hf["base"]["outputs"]
    assert stats == _stats(0)


def test_batched_max_model_len_cap(hf):
    """A max_model_len that cuts every prompt short: n_spec differs per row near the end (draft_tokens <
    K * drafts), the longest prompts have no room at all (empty output, no draft), rows leave at different
    steps. Batched = batch 1, exactly, with and without the draft."""
    req, k = hf["req"], hf["k"]
    lens = sorted(len(p) for p in req["prompts"])
    mml = lens[-3] + 1  # the longest prompts get limit <= 0
    kw = dict(hf["kw"], max_model_len=mml)
    ref = run_batch1(hf["target"], hf["draft"], req["prompts"], k, **kw)
    got = run_batched(hf["target"], hf["draft"], req["prompts"], k, 8, **kw)
    assert got[0] == ref[0]
    assert sum(o == [] for o in ref[0]) == sum(n >= mml for n in lens) >= 1  # no room: no output
    assert_proposals_close(got[2], ref[2])
    assert_counters_close(got[1], ref[1], k)
    assert 0 < ref[1]["draft_tokens"] < k * ref[1]["drafts"]  # the per-row cap was exercised
    plain = run_batched(hf["target"], None, req["prompts"], 0, 8, **kw)[0]
    assert plain == run_batch1(hf["target"], None, req["prompts"], 0, **kw)[0] == ref[0]


def test_batched_main_request(hf, work):
    """`python -m pipeline.engines.hf_spec_eval` with request["batch_size"] = 4 (two chunks of ragged
    prompts): vLLM's result schema, the greedy baseline outputs, batch-1 counters, vLLM's AL."""
    req, k = dict(hf["req"]), hf["k"]
    req["batch_size"] = 4
    req_path, res_path = work / "trained-b4.request.json", work / "trained-b4.result.json"
    req_path.write_text(json.dumps(req))
    proc = subprocess.run([sys.executable, "-m", "pipeline.engines.hf_spec_eval", str(req_path), str(res_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(res_path.read_text())
    assert set(res) == set(hf["vllm"]) and set(res["spec_decode"]) == set(hf["vllm"]["spec_decode"])
    assert res["outputs"] == hf["base"]["outputs"] and res["texts"] == hf["base"]["texts"]
    assert res["output_tokens"] == sum(map(len, res["outputs"])) and res["generation_s"] > 0
    assert_counters_close(res["spec_decode"], hf["stats"], k)
    mine, theirs = _al(res["spec_decode"], k), _al(hf["vllm"]["spec_decode"], k)
    print(f"main batch 4: {res['spec_decode']} in {res['generation_s']:.1f}s; vLLM {hf['vllm']['spec_decode']}")
    assert mine["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=0.05)
