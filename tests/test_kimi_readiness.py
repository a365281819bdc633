"""Kimi-K2.5 readiness without the model: layer ids from a K2.5-shaped config (text_config nesting),
conversion to the SGLang/SpecForge convention, the target-precision guard of eval."""
import json

import pytest

from pipeline.config import Config
from pipeline.evaluate import check_precision
from pipeline.extract import resolve_layer_ids
from pipeline.layers import num_layers, to_convention
from pipeline.manifest import StepError

# The shape of Kimi-K2.5's config.json (values from the public model card/config; weights not needed)
KIMI_K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "first_k_dense_replace": 1,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "num_attention_heads": 64, "quantization_config": {"quant_method": "compressed-tensors"},
    },
    "vision_config": {"model_type": "moonvit", "hidden_size": 1152, "num_hidden_layers": 27},
}


@pytest.fixture
def kimi_cfg(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
    cfg = Config()
    cfg.model.path = str(tmp_path)
    cfg.model.trust_remote_code = True
    return cfg


def test_layer_ids_from_nested_text_config(kimi_cfg):
    assert num_layers(KIMI_K25_CONFIG) == 61  # not the vision tower's 27
    assert resolve_layer_ids(kimi_cfg) == ([2, 30, 58, 61], 61, 7168)
    kimi_cfg.extract.layer_ids = [2, 30, 58, 61]  # what configs/kimi-k2.5-*.toml say
    assert resolve_layer_ids(kimi_cfg)[0] == [2, 30, 58, 61]
    kimi_cfg.extract.layer_ids = [3, 31, 59, 62]  # the speculators <= 0.4 "after layer" ids + 1: out of range
    with pytest.raises(StepError, match=r"\[62\] out of range.*1\.\.61"):
        resolve_layer_ids(kimi_cfg)


def test_sglang_conversion_for_61_layers():
    # SpecForge configs/deepseek-v3-671b-eagle3.json uses [1, 29, 57] (output-of-layer)
    assert to_convention([2, 30, 58], "after_layer") == [1, 29, 57]
    assert to_convention([2, 30, 58, 61], "after_layer") == [1, 29, 57, 60]


def test_kimi_configs_say_the_defaults():
    from pipeline.config import load_config

    for name in ("kimi-k2.5-b300", "kimi-k2.5-devbox"):
        cfg = load_config(f"configs/{name}.toml")
        assert cfg.extract.layer_ids == [2, 30, 58, 61]
        assert cfg.model.trust_remote_code is True
        assert cfg.model.precision == "int4-compressed-tensors"


def test_eval_refuses_a_precision_mismatch():
    cfg = Config()
    cfg.model.precision = "bf16"
    check_precision(cfg, {"precision": "bf16"})
    check_precision(cfg, {})  # manifests from before the key: the config's precision
    with pytest.raises(StepError, match=r"'int4-compressed-tensors' target but eval would run a 'bf16' target"):
        check_precision(cfg, {"precision": "int4-compressed-tensors"})
    cfg.eval.allow_precision_mismatch = True
    check_precision(cfg, {"precision": "int4-compressed-tensors"})
