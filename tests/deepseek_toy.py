"""A tiny random-weight DeepSeek-V3-architecture checkpoint (transformers' DeepseekV3ForCausalLM), built
locally: 4 layers (first dense), MLA with small ranks, 4 routed + 1 shared expert, the Kimi-like
tokenizer and chat template of tests/kimi_toy.py (byte-level, 270 tokens). Saved as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

from tests.kimi_toy import fast_kimi_tokenizer

TINY = dict(
    vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=2048,
    tie_word_embeddings=False, topk_method="noaux_tc", scoring_func="sigmoid",
)


def build(dest: Path) -> Path:
    """Build once (idempotent: a complete folder is reused)."""
    dest = Path(dest)
    if (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists():
        return dest
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

    tok = fast_kimi_tokenizer()
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = DeepseekV3Config(**TINY, bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # a non-degenerate router: spread the expert scores
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(dest)
    model.save_pretrained(dest)
    return dest


def conversations(path: Path, n: int = 16) -> Path:
    """A small local conversation file (ShareGPT layout) with inline reasoning in assistant turns."""
    rows = []
    for i in range(n):
        rows.append({"id": f"toy-{i}", "conversations": [
            {"from": "human", "value": f"Question number {i}: what is {i} plus {i + 1}?"},
            {"from": "gpt", "value": f"<think>Add {i} and {i + 1}.</think>The answer is {2 * i + 1}. Anything else about number {i}?"},
            {"from": "human", "value": "Say it in words."},
            {"from": "gpt", "value": f"It is the sum of {i} and {i + 1}, which is {2 * i + 1}."},
        ]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
