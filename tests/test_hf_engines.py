"""The transformers ("hf") engines against the vLLM engines they stand in for on GPU hosts without vLLM:
extraction (same files, same tensors), regeneration (same greedy tokens) and evaluation (same outputs,
same spec-decode counters). Also the hf EAGLE-3 draft against speculators' own (training) forward."""
from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import json
import lzma
import subprocess
import sys

import pytest
import torch

from pipeline.hidden_states import check_header, file_name, load
from tests.conftest import LAYER_IDS, REPO


MIN_COSINE = 0.999


@contextlib.contextmanager
def _one_thread():
    """Token-by-token decoding on CPU: one thread (two wait on each other on a busy 2-core host)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Mean over tokens of the cosine per layer: [T, L, H] x2 -> L values."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean(0).tolist()


def test_hf_extraction_matches_vllm_files(data_run, runs_dir):
    from pipeline.engines.hf_engine import extract_hf, hidden_states_batch, load_target
    from pipeline.extract import SPLITS, load_samples, resolve_layer_ids

    layer_ids, n, hidden = resolve_layer_ids(data_run)
    assert layer_ids == LAYER_IDS
    samples = load_samples(data_run)[::3]  # 7 of the 21 samples, both splits
    assert {s[0] for s in samples} == set(SPLITS)
    out = runs_dir / "hf-extract"
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(data_run)
    cfg.extract.batch_size = 2  # 2 x 512 padded tokens a batch: several batches, most of them padded
    stats = extract_hf(cfg, samples, out, layer_ids, hidden)
    assert stats["tokens_extracted"] == sum(len(ids) for _, _, ids in samples)
    assert sorted(p.name for p in out.rglob("*") if p.is_file() and not p.name.startswith("hs_")) == []

    vllm_dir = data_run.step_dir("extract")
    worst = [1.0] * len(layer_ids)
    for split, i, ids in samples:
        mine, theirs = out / split / file_name(i), vllm_dir / split / file_name(i)
        assert check_header(mine, len(ids), len(layer_ids), hidden) is None
        hs, tok = load(mine)
        ref, ref_tok = load(theirs)
        assert hs.dtype == ref.dtype == getattr(torch, data_run.model.dtype) and tok.dtype == torch.int64
        assert hs.shape == ref.shape and tok.tolist() == ref_tok.tolist() == ids
        cos = _cosines(hs, ref)
        assert min(cos) >= MIN_COSINE, f"{split}/{i}: per-layer mean cosine {cos} (ids {layer_ids})"
        worst = [min(w, c) for w, c in zip(worst, cos)]
    print(f"hf vs vLLM extraction, worst per-layer mean cosine over {len(samples)} files: "
          f"{dict(zip(layer_ids, (round(w, 6) for w in worst)))}")

    # The threshold tells layers apart: the neighbouring layer (the HF off-by-one) fails it.
    split, i, ids = min(samples, key=lambda s: len(s[2]))
    model = load_target(data_run.model_path, data_run.model.dtype)
    shifted = hidden_states_batch(model, [ids], [k - 1 for k in layer_ids])[0]
    ref, _ = load(vllm_dir / split / file_name(i))
    assert min(_cosines(shifted, ref)) < MIN_COSINE


def test_hf_greedy_generation_matches_vllm(trained_run):
    """Batched (left-padded) hf greedy generation = vLLM's float32 greedy eval baseline."""
    from transformers import AutoTokenizer

    from pipeline.engines.hf_engine import generate, stop_token_ids

    out = trained_run.step_dir("eval")
    req = json.loads((out / "baseline.request.json").read_text())
    res = json.loads((out / "baseline.result.json").read_text())
    assert req["dtype"] == "float32"
    prompts = req["prompts"][:3]
    assert len(set(map(len, prompts))) > 1  # the batch really is padded
    with _one_thread():
        gens = generate(req["model"], prompts, dtype="float32", batch_size=3, max_new_tokens=req["max_tokens"],
                        temperature=0.0, seed=0)
    stop = stop_token_ids(req["model"], AutoTokenizer.from_pretrained(req["model"]))
    for g, ids, text in zip(gens, res["outputs"], res["texts"]):
        assert g.token_ids == ids
        assert g.text == text
        assert g.finish_reason == ("stop" if ids[-1] in stop else "length")


def test_hf_generation_stops_rows_at_eos(smollm2):
    """In one left-padded batch, a row that ends (EOS kept, "stop") leaves the others running; every
    row is what the one-prompt greedy decoder gives."""
    from transformers import AutoTokenizer

    from pipeline.engines import hf_engine
    from pipeline.engines.hf_engine import generate, load_target
    from pipeline.engines.hf_spec_eval import decode

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = []
    for text in ("Say hello.", "Reply with one word: is the sky blue?", "Write a long poem about the sea."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    with _one_thread():
        gens = generate(smollm2, prompts, dtype="float32", batch_size=3, max_new_tokens=24, progress=False)
        target = load_target(smollm2, "float32")
        refs = [decode(target, p, max_tokens=24, max_model_len=1024, stop={tok.eos_token_id}) for p in prompts]
        # the path for sliding-window / remote-code models (transformers' own cache and masks) gives the same
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf_engine, "_static_decode_ok", lambda model: False)
            dynamic = generate(smollm2, prompts, dtype="float32", batch_size=3, max_new_tokens=24, progress=False)
    assert [g.token_ids for g in gens] == refs
    assert [g.token_ids for g in dynamic] == refs
    reasons = [g.finish_reason for g in gens]
    assert "stop" in reasons and "length" in reasons, reasons
    for g in gens:
        assert (g.token_ids[-1] == tok.eos_token_id) == (g.finish_reason == "stop")
        assert len(g.token_ids) == 24 or g.finish_reason == "stop"
        assert g.text == tok.decode(g.token_ids, skip_special_tokens=True)


def test_hf_generation_halves_a_batch_that_runs_out_of_memory(smollm2, capsys):
    """A batch that runs out of GPU memory is retried at half the size and the rest goes on at that size, with
    the same answers in prompt order; at a batch of one the error is raised (session 35: data.batch_size=2048
    ran out of memory on an H100)."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.engines import hf_engine
    from pipeline.engines.hf_engine import generate

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = []
    for text in ("Say hello.", "Name a colour.", "Count to three.", "What is two plus two?", "Name a fruit."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    real, sizes = hf_engine.generate_batch, []

    def out_of_memory_above(limit):
        def fake(model, batch, **kw):
            sizes.append(len(batch))
            if len(batch) > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.59 GiB (simulated)")
            return real(model, batch, **kw)
        return fake

    with _one_thread():
        want = [g.token_ids for g in generate(smollm2, prompts, dtype="float32", batch_size=1, max_new_tokens=6,
                                              progress=False)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf_engine, "generate_batch", out_of_memory_above(2))
            got = generate(smollm2, prompts, dtype="float32", batch_size=5, max_new_tokens=6, progress=False)
            assert sizes == [5, 2, 2, 1]
            assert [g.token_ids for g in got] == want
            assert "a batch of 5 prompts ran out of GPU memory; going on at 2" in "".join(capsys.readouterr())
            sizes.clear()
            mp.setattr(hf_engine, "generate_batch", out_of_memory_above(0))
            with pytest.raises(torch.OutOfMemoryError):
                generate(smollm2, prompts, dtype="float32", batch_size=5, max_new_tokens=6, progress=False)
            assert sizes == [5, 2, 1]


def test_static_decode_only_for_models_whose_every_layer_sees_the_whole_context():
    """The StaticCache + 4-D mask path builds full causal masks: a sliding-window layer would silently attend too
    far. Such models (and remote code) must take transformers' own masks."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from pipeline.engines.hf_engine import _static_decode_ok

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64)
    assert _static_decode_ok(LlamaForCausalLM(LlamaConfig(**tiny)))
    assert not _static_decode_ok(MistralForCausalLM(MistralConfig(**tiny, sliding_window=16)))
    assert _static_decode_ok(MistralForCausalLM(MistralConfig(**tiny, sliding_window=None)))
    assert _static_decode_ok(Qwen2ForCausalLM(Qwen2Config(**tiny, use_sliding_window=False)))
    assert not _static_decode_ok(Qwen2ForCausalLM(Qwen2Config(**tiny, use_sliding_window=True, sliding_window=16,
                                                              max_window_layers=0)))


def _spec(result: dict, k: int) -> dict:
    from pipeline.evaluate import spec_metrics

    return spec_metrics(result["spec_decode"], k)


def test_hf_evaluator_agrees_with_vllm(trained_run, runs_dir):
    """hf_spec_eval on the trained drafter's request: the same outputs as vLLM's greedy baseline and
    the same acceptance (AL, per position) as vLLM measured."""
    out = trained_run.step_dir("eval")
    req_path = out / "trained.request.json"
    req = json.loads(req_path.read_text())
    k = req["speculative_config"]["num_speculative_tokens"]
    vllm_res = json.loads((out / "trained.result.json").read_text())
    base = json.loads((out / "baseline.result.json").read_text())
    res_path = runs_dir / "hf-trained.result.json"
    res_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pipeline.engines.hf_spec_eval", str(req_path), str(res_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(res_path.read_text())

    assert set(res) == set(vllm_res) and set(res["spec_decode"]) == set(vllm_res["spec_decode"])
    assert res["outputs"] == base["outputs"]  # exact greedy: speculative output = plain greedy output
    assert res["texts"] == base["texts"]
    assert res["output_tokens"] == sum(map(len, base["outputs"]))
    mine, theirs = _spec(res, k), _spec(vllm_res, k)
    print(f"AL hf {mine['acceptance_length']} vs vLLM {theirs['acceptance_length']}; per position hf "
          f"{mine['per_position_acceptance']} vs vLLM {theirs['per_position_acceptance']}; drafts "
          f"{mine['drafts']} vs {theirs['drafts']}; generation {res['generation_s']:.1f}s vs {vllm_res['generation_s']:.1f}s")
    s = res["spec_decode"]
    assert s["drafts"] > 0 and s["draft_tokens"] == k * s["drafts"]  # far from max_model_len: always K
    assert len(s["accepted_per_pos"]) == k and s["accepted_tokens"] == sum(s["accepted_per_pos"])
    assert all(a >= b for a, b in zip(s["accepted_per_pos"], s["accepted_per_pos"][1:]))
    # every output token but the prefill's comes from a verification step (1 + accepted each); the
    # last step of a prompt may overshoot max_tokens / EOS, which vLLM still counts
    overshoot = s["drafts"] + s["accepted_tokens"] - (res["output_tokens"] - len(res["outputs"]))
    assert 0 <= overshoot <= k * len(res["outputs"])
    assert mine["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=0.05)
    for a, b in zip(mine["per_position_acceptance"], theirs["per_position_acceptance"]):
        assert a == pytest.approx(b, abs=0.05)
    assert abs(mine["drafts"] - theirs["drafts"]) <= max(2, 0.03 * theirs["drafts"])


def test_hf_draft_matches_speculators_forward(trained_run):
    """The hf EAGLE-3 draft computes what speculators trained: its first pass over a sample (token t+1
    with the target features at t, position t) and a chained step (the draft's own output state, the
    next position, attending to the first pass) give the logits of Eagle3DraftModel.forward at TTT
    steps 0 and 1 (teacher-forced tokens), on the extracted hidden states, in float32."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from pipeline.engines.hf_engine import load_target
    from pipeline.engines.hf_spec_eval import Eagle3Draft

    ckpt = trained_run.step_dir("train") / "checkpoint"
    conf = Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
    conf.transformer_layer_config._attn_implementation = "sdpa"
    ref = Eagle3DraftModel.from_pretrained(str(ckpt), config=conf).float().eval()
    target = load_target(trained_run.model_path, "float32")
    draft = Eagle3Draft(ckpt, target, torch.float32, torch.device("cpu"))
    assert draft.aux_ids == LAYER_IDS[:-1] == list(ref.target_layer_ids)

    hs, tok = load(trained_run.step_dir("extract") / "train" / file_name(0))
    aux = hs[:, : len(draft.aux_ids)].float().reshape(hs.shape[0], -1)  # ids 4, 14, 26 of [4, 14, 26, 30]
    t = min(hs.shape[0], 96)
    ref_logits = []
    hook = ref.lm_head.register_forward_hook(lambda _m, _i, o: ref_logits.append(o[0]))
    with torch.no_grad():
        ref(hidden_states=aux[None, : t - 1], input_ids=tok[None, 1:t],
            document_ids=torch.zeros(1, t - 1, dtype=torch.long), ttt_steps=2)
    hook.remove()

    def hf_logits(shift: int = 0):
        with torch.no_grad():
            draft.reset()
            post, hid = draft.forward(tok[1:t], draft.combine(aux[: t - 1]), torch.arange(t - 1))
            first = torch.nn.functional.linear(post, draft.lm_head)
            keys, values = list(draft.k_cache), list(draft.v_cache)
            second = []
            for i in range(t - 2):  # chained step from position i: token i+2, own state at i, position i+1
                draft.k_cache, draft.v_cache = [x[:, : i + 1] for x in keys], [x[:, : i + 1] for x in values]
                p, _ = draft.forward(tok[i + 2: i + 3], hid[i: i + 1], torch.tensor([i + 1 + shift]))
                second.append(torch.nn.functional.linear(p, draft.lm_head))
        return (first - ref_logits[0]).abs().max().item(), (torch.cat(second) - ref_logits[1][: t - 2]).abs().max().item()

    d0, d1 = hf_logits()
    assert d0 < 1e-3 and d1 < 1e-3, (d0, d1)
    # the comparison can fail: the chained step one position off moves the logits far beyond that
    assert hf_logits(shift=1)[1] > 1e-2


class _ScriptedDraft:
    """Stands in for Eagle3Draft in hf_spec_eval.decode: proposes the target's own greedy continuation
    with every `every`-th proposed token replaced, so the accepted prefix of each proposal is known."""

    aux_ids: list[int] = [4]

    def __init__(self, greedy: list[int], prompt_len: int, every: int):
        self.greedy, self.prompt_len, self.every, self.calls = greedy, prompt_len, every, 0
        self.cached = 0

    def reset(self):
        self.cached = 0

    def propose(self, token_ids, aux, start, k):
        assert start == self.cached and aux.shape[0] == token_ids.shape[0]  # every committed position, once
        self.cached += token_ids.shape[0]
        done = self.cached + 1 - self.prompt_len  # output tokens so far (the last one not yet verified)
        out = []
        for j in range(k):
            self.calls += 1
            t = self.greedy[done + j]
            out.append(t + 1 if self.calls % self.every == 0 else t)
        return out


def test_hf_spec_decode_accepts_and_counts_like_vllm(smollm2):
    """Verification, KV-cache rollback and vLLM's counters with proposals whose acceptance is known:
    the output stays the plain greedy one and the counters match a replay of vLLM's rules."""
    from transformers import AutoTokenizer

    from pipeline.engines.hf_engine import load_target
    from pipeline.engines.hf_spec_eval import decode

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                     tokenize=True, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    target = load_target(smollm2, "float32")
    k, max_tokens, every = 3, 30, 4
    stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * k}
    with _one_thread():
        greedy = decode(target, prompt, max_tokens=max_tokens + k, max_model_len=1024, stop=set())
        draft = _ScriptedDraft(greedy, len(prompt), every)
        got = decode(target, prompt, max_tokens=max_tokens, max_model_len=1024, stop=set(), draft=draft, k=k,
                     stats=stats)
    assert got == greedy[:max_tokens]

    # replay: a draft per verification step, counted in full even where it runs past max_tokens
    want = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * k}
    n, calls = 1, 0
    while n < max_tokens:
        bad = [(calls + j + 1) % every == 0 for j in range(k)]
        calls += k
        a = bad.index(True) if True in bad else k
        want["drafts"] += 1
        want["draft_tokens"] += k
        want["accepted_tokens"] += a
        for i in range(a):
            want["accepted_per_pos"][i] += 1
        n += a + 1
    assert stats == want
    assert want["accepted_per_pos"][k - 1] > 0 and want["accepted_tokens"] < k * want["drafts"]


def test_prepare_resumes_an_interrupted_regeneration(smollm2, runs_dir):
    """A kill during regeneration keeps the answers finished so far; the rerun reuses them, generates
    only the rest, and ends with the same data as an uninterrupted run."""
    from pipeline import steps
    from pipeline.config import load_config
    from pipeline.engines import hf_engine
    from pipeline.prepare import REGEN_CACHE
    from tests.conftest import SMALL, write_config

    data = {**SMALL["data"], "engine": "hf", "max_conversations": 6, "max_new_tokens": 8, "batch_size": 2}
    cfg = load_config(write_config(runs_dir / "regen-resume.toml", runs_dir, "regen-resume", **{**SMALL, "data": data}))
    steps.run(cfg, "model")
    real, calls = hf_engine.generate_batch, []

    def dies_on_the_second_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*a, **kw)

    with _one_thread(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_engine, "generate_batch", dies_on_the_second_batch)
        with pytest.raises(KeyboardInterrupt):
            steps.run(cfg, "prepare")
    out = cfg.step_dir("prepare")
    assert len((out / REGEN_CACHE).read_text().splitlines()) == 2  # the first batch survived the kill
    assert not (out / "manifest.json").exists()

    with _one_thread():
        s = steps.run(cfg, "prepare")["summary"]
    assert s["reused_from_interrupted_run"] == 2
    assert s["regenerated_turns"] == s["selected"] - s["turns_dropped_prompt_too_long"]
    assert not (out / REGEN_CACHE).exists()
    resumed = (out / "conversations.jsonl").read_text()

    with _one_thread():
        s = steps.run(cfg, "prepare", force=True)["summary"]  # uninterrupted, from scratch
    assert s["reused_from_interrupted_run"] == 0
    assert (out / "conversations.jsonl").read_text() == resumed


def test_prepare_keeps_agentic_trajectories_or_flattens_them_when_regenerating(smollm2, runs_dir, work):
    """Agentic conversations from a JSONL file: with data.regenerate = "off" prepare trains on them as given (tool
    results in the context, never in the loss); with regeneration they are flattened to user turns and the
    target's answers, counted and warned about, and lose their tools list (the answers never saw it)."""
    from pipeline import steps
    from pipeline.config import load_config
    from tests.conftest import SMALL, write_config
    from tests.test_kimi_format import CONV, TOOLS

    records = []
    for k, city in enumerate(["Paris", "Oslo", "Lima", "Kyiv"]):
        conv = json.loads(json.dumps(CONV).replace("Paris", city))
        conv[2]["content"] = None  # as OpenAI-style logs store a call-only turn
        records.append({"id": f"agent-{k}", "messages": conv, "tools": TOOLS})
        records.append({"id": f"plain-{k}", "messages": [
            {"role": "user", "content": f"Name three facts about {city}."},
            {"role": "assistant", "content": f"{city} is a capital city. It has a long history. Many people visit it."}]})
    path = work / "agentic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def prepare(name, regenerate):
        data = {**SMALL["data"], "path": str(path), "regenerate": regenerate, "engine": "hf", "max_new_tokens": 8,
                "batch_size": 4, "min_assistant_tokens": 1, "eval_fraction": 0.5}
        cfg = load_config(write_config(runs_dir / f"{name}.toml", runs_dir, name, **{**SMALL, "data": data}))
        steps.run(cfg, "model")
        with _one_thread():
            s = steps.run(cfg, "prepare")["summary"]
        convs = [json.loads(x) for x in (cfg.step_dir("prepare") / "conversations.jsonl").read_text().splitlines()]
        return cfg, s, {c["id"]: c for c in convs}

    cfg, s, convs = prepare("agentic-off", "off")
    assert s["usable_conversations"] == 8 and s["train_samples"] + s["eval_samples"] == 8
    assert "agentic_conversations_flattened" not in s
    assert convs["agent-1"]["tools"] == TOOLS and [m["role"] for m in convs["agent-1"]["messages"]] == \
        [m["role"] for m in CONV]
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cfg.model_path))
    rows = [r for split in ("train", "eval") for r in load_from_disk(str(cfg.step_dir("prepare") / split))]
    row = next(r for r in rows if r["id"] == "agent-1")
    trained = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "18C, sunny" in tok.decode(row["input_ids"]) and "18C, sunny" not in trained  # the tool's result
    assert "It is 18C and sunny." in trained

    _, s, convs = prepare("agentic-regen", "first_turn")
    assert s["agentic_conversations_flattened"] == 4 and s["regenerated_turns"] == 8
    for cid, c in convs.items():
        roles = [m["role"] for m in c["messages"]]
        assert "tools" not in c and not any(m.get("tool_calls") for m in c["messages"])
        assert roles == (["system", "user", "assistant"] if cid.startswith("agent") else ["user", "assistant"])


def test_prepare_refuses_an_empty_eval_split(smollm2, runs_dir, work):
    """Three conversations at eval_fraction 0.01 all land in train: a clear error naming the config and the keys
    to change, not an IndexError from datasets when verify or training loads the empty split."""
    from pipeline import steps
    from pipeline.config import load_config
    from pipeline.manifest import StepError
    from tests.conftest import SMALL, write_config

    path = work / "three.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": f"Answer number {k}."}]}) + "\n"
        for k in range(3)))
    data = {**SMALL["data"], "path": str(path), "regenerate": "off", "eval_fraction": 0.01, "min_assistant_tokens": 1}
    cfg = load_config(write_config(runs_dir / "no-eval.toml", runs_dir, "no-eval", **{**SMALL, "data": data}))
    steps.run(cfg, "model")
    with pytest.raises(StepError, match=r"no eval samples.*data\.eval_fraction.*no-eval\.toml"):
        steps.run(cfg, "prepare")
    assert not (cfg.step_dir("prepare") / "manifest.json").exists()


def test_prepare_reuses_answers_seeded_from_an_earlier_run(smollm2, runs_dir):
    """data.seed_answers (how a GPU session skips regenerating): a fresh run seeded with an earlier run's
    conversations generates nothing and ends with the same conversations."""
    from pipeline import steps
    from pipeline.config import load_config
    from tests.conftest import SMALL, write_config

    data = {**SMALL["data"], "engine": "hf", "max_conversations": 6, "max_new_tokens": 8, "batch_size": 3}
    first = load_config(write_config(runs_dir / "seed-a.toml", runs_dir, "seed-a", **{**SMALL, "data": data}))
    for s in ("model", "prepare"):
        with _one_thread():
            steps.run(first, s)
    earlier = first.step_dir("prepare") / "conversations.jsonl"

    s = _seeded_prepare(runs_dir, "seed-b", data, earlier)
    assert s["seeded_answers"] == s["regenerated_turns"] > 0 and s["reused_from_interrupted_run"] == 0
    assert s["seed_answers"]["sha256"] == hashlib.sha256(earlier.read_bytes()).hexdigest()


def _seed_tool(*args, check=True) -> subprocess.CompletedProcess:
    """tests/bench/h200/seed_regen_cache.py ARGS (--answers-only: the repository's seed), in its own process."""
    return subprocess.run([sys.executable, str(REPO / "tests/bench/h200/seed_regen_cache.py"), *map(str, args)],
                          check=check, cwd=REPO, capture_output=not check, text=True)


def _seeded_prepare(runs_dir, name: str, data: dict, earlier, same_as=None) -> dict:
    """A fresh run with data.seed_answers = an earlier run's conversations (or their answers): its prepare must
    generate nothing and end with the same conversations. -> prepare's summary."""
    from pipeline import steps
    from pipeline.config import load_config
    from pipeline.engines import hf_engine
    from tests.conftest import SMALL, write_config

    second = load_config(write_config(runs_dir / f"{name}.toml", runs_dir, name,
                                      **{**SMALL, "data": {**data, "seed_answers": str(earlier)}}))
    steps.run(second, "model")

    def must_not_generate(*a, **kw):
        raise AssertionError("a seeded answer was generated again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_engine, "generate_batch", must_not_generate)
        s = steps.run(second, "prepare")["summary"]
    assert (second.step_dir("prepare") / "conversations.jsonl").read_text() == (same_as or earlier).read_text()
    return s


def test_all_turn_regeneration_keeps_the_context_and_seeds_exactly(smollm2, runs_dir, work):
    """data.regenerate = "all_turns": each answer is generated with the target's earlier answers in context; a
    conversation ends at its first turn whose prompt is too long (a later short question must not be answered
    in a context where the long one was never asked); an all-turn run seeds a fresh one exactly (the H200 plan:
    regenerate once, carry the conversations back, train in a later session)."""
    from pipeline import steps
    from pipeline.config import load_config
    from tests.conftest import SMALL, write_config

    from pipeline.manifest import StepError

    topics = ["rivers", "bread", "chess", "volcanoes", "tides"]
    convs = [{"id": f"mt-{i}", "messages": [
        {"role": "user", "content": f"Tell me one fact about {t}."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": f"Why does that matter for {t}?"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Say it in five words."}, {"role": "assistant", "content": "x"}]}
        for i, t in enumerate(topics)]
    long_turn = "Please read this carefully. " + "the quick brown fox jumps over the lazy dog " * 160
    convs.append({"id": "mt-long", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": long_turn}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "And another one?"}, {"role": "assistant", "content": "x"}]})
    src = work / "multi-turn.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    data = {**SMALL["data"], "engine": "hf", "max_conversations": 0, "max_new_tokens": 8, "batch_size": 4,
            "regenerate": "all_turns", "path": str(src), "eval_fraction": 0.2}
    first = load_config(write_config(runs_dir / "allturns-a.toml", runs_dir, "allturns-a", **{**SMALL, "data": data}))
    for s in ("model", "prepare"):
        with _one_thread():
            summary = steps.run(first, s)["summary"]
    assert summary["turns_dropped_prompt_too_long"] == 1
    assert summary["regenerated_turns"] == 3 * len(topics) + 1
    earlier = first.step_dir("prepare") / "conversations.jsonl"
    users_of = {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "user"] for c in convs}
    for line in earlier.read_text().splitlines():
        c = json.loads(line)
        users = [m["content"] for m in c["messages"] if m["role"] == "user"]
        answers = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
        assert users == users_of[c["id"]][: len(users)], f"{c['id']}: a user turn was skipped"
        assert len(answers) == len(users) and "x" not in answers  # every answer is the target's
        assert len(users) == (1 if c["id"] == "mt-long" else 3)

    s = _seeded_prepare(runs_dir, "allturns-b", data, earlier)
    assert s["seeded_answers"] == s["regenerated_turns"] == summary["regenerated_turns"]
    assert s["reused_from_interrupted_run"] == 0
    # the answers-only form (data/seeds/: the target's answers without the prompts, xz as the repository keeps it)
    # seeds exactly as well, its prompts from this run's own source
    answers = runs_dir / "allturns-answers.jsonl.xz"
    _seed_tool("--answers-only", earlier, answers)
    s = _seeded_prepare(runs_dir, "allturns-c", data, answers, same_as=earlier)
    assert s["seeded_answers"] == summary["regenerated_turns"]
    # a seed answers only the prompts it answered: where a user turn in its context differs, that conversation is
    # generated (its later rounds too: the seed's context for them holds the edited turn), and the rest is seeded
    changed = runs_dir / "allturns-changed.jsonl"
    lines = [json.loads(x) for x in earlier.read_text().splitlines()]
    first_user = next(m for m in lines[0]["messages"] if m["role"] == "user")
    first_user["content"] += " (edited)"
    changed.write_text("".join(json.dumps(c) + "\n" for c in lines))
    rounds_0 = sum(m["role"] == "assistant" for m in lines[0]["messages"])
    assert rounds_0 > 1
    cfg = load_config(write_config(runs_dir / "allturns-f.toml", runs_dir, "allturns-f",
                                   **{**SMALL, "data": {**data, "seed_answers": str(changed)}}))
    steps.run(cfg, "model")
    with _one_thread():
        s = steps.run(cfg, "prepare")["summary"]
    assert s["seeded_answers"] == summary["regenerated_turns"] - rounds_0
    assert s["reused_from_interrupted_run"] == 0
    made = {json.loads(x)["id"]: x for x in (cfg.step_dir("prepare") / "conversations.jsonl").read_text().splitlines()}
    assert all(json.loads(made[c["id"]]) == c for c in lines[1:])  # the seeded ones, as they were

    # refusals, each naming the file and the fix, before prepare's folder is touched: a seed that is not there (a
    # --force of the finished allturns-b run keeps its outputs), the source's answers themselves (never regenerated),
    # an answers-only seed whose .json names another file under the same source tag, a run that regenerates nothing
    done = runs_dir / "allturns-b" / "prepare" / "manifest.json"
    before = done.read_bytes()

    def refused(name: str, pattern: str, **data_keys) -> None:
        c = load_config(write_config(runs_dir / f"{name}.toml", runs_dir, name,
                                     **{**SMALL, "data": {**data, **data_keys}}))
        steps.run(c, "model")
        with pytest.raises(StepError, match=pattern):
            steps.run(c, "prepare", force=True)

    refused("allturns-b", r"data\.seed_answers: .*no-such\.jsonl\.xz is not a file.*allturns-b\.toml.*set it to",
            seed_answers=str(runs_dir / "no-such.jsonl.xz"))
    assert done.read_bytes() == before
    refused("allturns-h", r"line 1: conversation .* was not regenerated", seed_answers=str(src))
    (runs_dir / "allturns-answers.json").write_text(json.dumps({"sources": [{"tag": "multi-turn", "sha256": "0" * 64}]}))
    refused("allturns-i", r"does not fit this run: source .*multi-turn\.jsonl is not the file the answers were made from",
            seed_answers=str(answers))
    (runs_dir / "allturns-answers.json").write_text(json.dumps({"settings": {"max_new_tokens": 999}}))
    refused("allturns-i", r"data\.max_new_tokens = 8, the seed was made with 999", seed_answers=str(answers))
    (runs_dir / "allturns-answers.json").unlink()
    refused("allturns-j", r"data\.regenerate = \"off\": nothing is generated", seed_answers=str(answers), regenerate="off")
    # a session's new answers are merged into the seed by id (the seed is one of the inputs); a clash is refused
    merged = runs_dir / "allturns-merged.jsonl.xz"
    _seed_tool("--answers-only", answers, earlier, merged)
    assert merged.read_bytes() == answers.read_bytes()
    # gzip, by OUT's name (the seed's form until session 36): the same text
    as_gzip = runs_dir / "allturns-merged.jsonl.gz"
    _seed_tool("--answers-only", answers, as_gzip)
    assert gzip.decompress(as_gzip.read_bytes()) == lzma.decompress(answers.read_bytes())
    other = runs_dir / "allturns-other.jsonl"
    rec = json.loads(lzma.decompress(answers.read_bytes()).decode().splitlines()[0])
    other.write_text(json.dumps({"id": rec["id"], "answers": ["another answer"]}) + "\n")
    clash = _seed_tool("--answers-only", answers, other, merged, check=False)
    assert clash.returncode != 0 and rec["id"] in clash.stderr, clash.stderr
