"""Independent reference: hidden states from a plain transformers forward pass.

Used by `verify` (parity against the engine that extracted the data). It maps vLLM layer ids to HF
`output_hidden_states` indices through pipeline.layers, and takes id N from a forward hook on the last
decoder layer (HF index N is after the final norm, vLLM id N is before it).
"""
from __future__ import annotations

import torch

from ..layers import hf_reference_index


def load_model(path, dtype: str = "bfloat16", trust_remote_code: bool = False, device: str = "cpu"):
    """The target in transformers, on `device` ("cpu", "cuda" or "auto": cuda when torch sees a GPU). Whatever the
    device, `hidden_states` returns CPU tensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    return model.to(resolve_device(device)).eval()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"the transformers reference was asked to run on {device!r}, but torch sees no CUDA device "
                           f"(torch {torch.__version__}): set verify.device = \"cpu\" or \"auto\" in the config")
    return torch.device(device)


def decoder_layers(model):
    return decoder_base(model).layers


def decoder_base(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if hasattr(base, "language_model"):  # multimodal wrappers (Kimi-K2.5)
        base = base.language_model
    return base


def final_norm_and_head(model):
    """(final norm, output embedding) of the target: what turns vLLM id N (the final pre-norm state) into logits;
    (None, None) when either is not found under the usual names."""
    head = model.get_output_embeddings()
    if head is None and hasattr(model, "language_model"):
        head = model.language_model.get_output_embeddings()
    base = decoder_base(model)
    norm = next((getattr(base, n) for n in ("norm", "final_layernorm", "ln_f") if hasattr(base, n)), None)
    return (norm, head) if norm is not None and head is not None else (None, None)


@torch.no_grad()
def hidden_states(model, token_ids, layer_ids: list[int]) -> torch.Tensor:
    """[T, len(layer_ids), H] in vLLM's convention for one sequence, or [B, T, len(layer_ids), H] for a batch
    of sequences of one length (a list of lists)."""
    batch = bool(token_ids) and isinstance(token_ids[0], (list, tuple))
    layers = decoder_layers(model)
    n = len(layers)
    captured = {}

    def hook(_mod, _inp, out):
        captured["last"] = out[0] if isinstance(out, tuple) else out

    handle = layers[-1].register_forward_hook(hook)
    try:
        out = model(torch.tensor(token_ids if batch else [token_ids], device=model.device), output_hidden_states=True,
                    use_cache=False)
    finally:
        handle.remove()
    cols = []
    for lid in layer_ids:
        idx = hf_reference_index(lid, n)
        cols.append(out.hidden_states[idx] if idx is not None else captured["last"])
    states = torch.stack(cols, dim=2).cpu()  # [B, T, L, H]
    return states if batch else states[0]
