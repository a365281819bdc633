"""Layer-id conventions: the one place where ids are converted between systems.

The pipeline stores every layer id in vLLM's convention:
  id k (0 < k < N) = residual stream ENTERING decoder layer k = HF `output_hidden_states[k]`
  id N             = output of the last decoder layer BEFORE the final norm
                     (HF `output_hidden_states[N]` is AFTER the final norm: not the same tensor)
Other conventions:
  "after_layer" (speculators <= 0.4 generator, SGLang/SpecForge): id j = output of decoder layer j
                 = vLLM id j + 1.
"""
from __future__ import annotations

CONVENTION = "vllm"  # recorded in manifests and hidden-state metadata
CONVENTIONS = ("vllm", "after_layer")


class LayerIdError(ValueError):
    pass


def num_layers(config: dict) -> int:
    """Decoder layer count from a HF config dict (multimodal wrappers nest it in text_config)."""
    return int(config.get("text_config", config)["num_hidden_layers"])


def default_layer_ids(n: int) -> list[int]:
    """EAGLE-3 defaults: three auxiliary layers (low/mid/high) + the final pre-norm state."""
    return [2, n // 2, n - 3, n]


def validate(ids: list[int], n: int, where: str = "extract.layer_ids") -> list[int]:
    if len(ids) < 2:
        raise LayerIdError(f"{where}: need at least 2 ids (aux layers + final), got {ids}")
    if sorted(set(ids)) != list(ids):
        raise LayerIdError(f"{where}: ids must be strictly increasing without repeats, got {ids}")
    bad = [i for i in ids if not 1 <= i <= n]
    if bad:
        raise LayerIdError(
            f"{where}: ids {bad} out of range for a {n}-layer model; vLLM convention allows 1..{n} "
            f"(id {n} = final pre-norm state). Default: {default_layer_ids(n)}"
        )
    return list(ids)


def to_convention(ids: list[int], convention: str) -> list[int]:
    """vLLM ids -> ids of another convention."""
    if convention == "vllm":
        return list(ids)
    if convention == "after_layer":
        return [i - 1 for i in ids]
    raise LayerIdError(f"unknown layer-id convention {convention!r}; known: {CONVENTIONS}")


def from_convention(ids: list[int], convention: str) -> list[int]:
    """Ids of another convention -> vLLM ids."""
    if convention == "vllm":
        return list(ids)
    if convention == "after_layer":
        return [i + 1 for i in ids]
    raise LayerIdError(f"unknown layer-id convention {convention!r}; known: {CONVENTIONS}")


def hf_reference_index(layer_id: int, n: int) -> int | None:
    """Index into HF `output_hidden_states` that equals vLLM id `layer_id`, or None for id N
    (the final pre-norm state has no HF index; use a hook on the last decoder layer's output)."""
    return layer_id if layer_id < n else None
