"""`plan`: what a run will cost before it starts -- tokens, hidden-state bytes, disk, time, draft size.

    python -m pipeline plan --config configs/X.toml [--target-config config.json]
                            [--conversations N] [--tokens-per-sample T] [--tokens-per-s R]

Tokens come from the prepare manifest when prepare has run; otherwise they are estimated as
conversations x data.seq_length/2 (the assumption is printed). Hidden-state bytes follow the file
format exactly (pipeline/hidden_states.py): T x len(layer_ids) x H x dtype bytes + T x 8 (int64 token
ids) + one safetensors header per sample. The draft size follows speculators 0.9.0's EAGLE-3 module
(checked against a real checkpoint by tests/test_scale.py). `extract` uses `disk_check` to refuse a run
the volume cannot hold.

Everything here is a pure function of (config, target config dict, numbers), so a 1T-parameter
target can be planned without its weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import Config
from .layers import LayerIdError, default_layer_ids, num_layers, validate

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HEADER_BYTES = 256  # safetensors header of one sample file (about 150 B measured) + 8-byte length, rounded up
TOKEN_ID_BYTES = 8  # token_ids are int64
DISK_MARGIN = 1.02  # keep 2 % of head room beyond the estimate


def text_config(conf: dict) -> dict:
    return conf.get("text_config", conf)


def target_shape(conf: dict) -> dict:
    """The numbers of the target that size the extraction and the drafter."""
    t = text_config(conf)
    hidden = int(t["hidden_size"])
    heads = int(t["num_attention_heads"])
    kv = int(t.get("num_key_value_heads") or heads)
    head_dim = t.get("head_dim")
    # speculators.train.cli.build_transformer_layer_config: head_dim from the verifier, else H / heads
    if head_dim and hidden % heads != 0 and hidden % int(head_dim) == 0:
        heads = hidden // int(head_dim)
        kv = heads if heads % kv else kv
    head_dim = int(head_dim or hidden // heads)
    # speculators.models.utils.resolve_draft_intermediate_size: the dense width, else 3 x H (MoE)
    inter = int(t.get("intermediate_size") or 3 * hidden)
    return {
        "num_hidden_layers": num_layers(conf), "hidden_size": hidden, "vocab_size": int(t["vocab_size"]),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "intermediate_size": inter, "attention_bias": bool(t.get("attention_bias", False)),
    }


def draft_params(shape: dict, num_layer_ids: int, draft_vocab: int, draft_layers: int = 1) -> dict[str, int]:
    """Parameter count per tensor group of speculators' EAGLE-3 drafter (tensors as saved)."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    aux = num_layer_ids - 1  # the last id is the final state: the verifier's input, not the draft's
    bias = (q + 2 * kv) if shape["attention_bias"] else 0
    # q/k/v read [embedding ; fused hidden] = 2H on every layer (speculators' _patch_eagle3_projections)
    attn = 2 * h * q + 2 * (2 * h * kv) + q * h + bias
    mlp = 3 * h * shape["intermediate_size"]
    layer_norms = 3 * h  # input_layernorm, post_attention_layernorm, hidden_norm
    return {
        "fc (aux*H -> H)": aux * h * h,
        "input_norm (aux*H)": aux * h,
        "decoder layers": draft_layers * (attn + mlp + layer_norms),
        "norm": h,
        "lm_head (draft_vocab x H)": draft_vocab * h,
        "embed_tokens (target_vocab x H, frozen)": v * h,
    }


def draft_size(shape: dict, num_layer_ids: int, draft_vocab: int, draft_layers: int = 1, dtype_bytes: int = 2) -> dict:
    groups = draft_params(shape, num_layer_ids, draft_vocab, draft_layers)
    total = sum(groups.values())
    frozen = groups["embed_tokens (target_vocab x H, frozen)"]
    vocab_maps = draft_vocab * 8 + shape["vocab_size"] * 1  # d2t int64 [draft_vocab], t2d bool [target_vocab]
    return {
        "params": groups,
        "total_params": total,
        "trainable_params": total - frozen,
        "weights_bytes": total * dtype_bytes,
        "checkpoint_bytes": total * dtype_bytes + vocab_maps,
        # AdamW in mixed precision: bf16 weights + fp32 master copy, gradient, two moments ~ 16 B / trainable param
        "training_state_bytes_estimate": (total - frozen) * 16 + frozen * dtype_bytes,
    }


def file_bytes(tokens: int, num_layer_ids: int, hidden: int, dtype: str) -> int:
    """Size of one sample's hidden-state file."""
    return tokens * (num_layer_ids * hidden * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES) + HEADER_BYTES


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def layer_ids_for(cfg: Config, conf: dict) -> list[int]:
    n = num_layers(conf)
    try:
        return validate(list(cfg.extract.layer_ids) or default_layer_ids(n), n)
    except LayerIdError as e:
        from .manifest import StepError

        raise StepError(f"{cfg.source_path}: {e}") from e


def _read_manifest(cfg: Config, step: str) -> dict | None:
    from .manifest import read_manifest

    return read_manifest(cfg.step_dir(step))


def measured_tokens_per_s(cfg: Config) -> float | None:
    """Extraction throughput of one engine, from the extract manifest or shard fragments of this run."""
    m = _read_manifest(cfg, "extract")
    if m and m.get("summary", {}).get("tokens_per_s"):
        return float(m["summary"]["tokens_per_s"])
    shards = sorted(cfg.step_dir("extract").glob("shards/*.json"))
    tok = sec = 0.0
    for p in shards:
        s = json.loads(p.read_text())
        tok += s.get("tokens_extracted", 0)
        sec += s.get("extract_s", 0)
    return round(tok / sec, 1) if sec else None


def plan(cfg: Config, target_conf: dict, *, conversations: int | None = None, tokens_per_sample: float | None = None,
         free: int | None = None, tokens_per_s: float | None = None, use_prepared: bool = True) -> dict:
    """The plan as a dict; `print_plan` renders it. Every input can be given, for tests and what-ifs."""
    shape = target_shape(target_conf)
    ids = layer_ids_for(cfg, target_conf)
    prepared = _read_manifest(cfg, "prepare") if use_prepared and conversations is None and tokens_per_sample is None else None
    notes = []
    if prepared:
        s = prepared["summary"]
        samples = int(s["train_samples"]) + int(s["eval_samples"])
        tokens = int(s["tokens"])
        token_source = f"prepared data ({cfg.step_dir('prepare')})"
    else:
        samples = conversations if conversations is not None else cfg.data.max_conversations
        if not samples:
            from .manifest import StepError

            raise StepError(
                "data.max_conversations = 0 (all) and prepare has not run: pass --conversations N for the estimate"
            )
        per = tokens_per_sample if tokens_per_sample is not None else cfg.data.seq_length / 2
        tokens = int(samples * per)
        token_source = "estimate"
        notes.append(
            ("prepare has not run: " if use_prepared and not _read_manifest(cfg, "prepare") else "")
            + f"tokens estimated as {samples} samples x {per:g} tokens/sample"
            + ("" if tokens_per_sample is not None else f" (assumption: data.seq_length/2 = {cfg.data.seq_length}/2)")
        )
    dtype_b = DTYPE_BYTES[cfg.model.dtype]
    per_token = len(ids) * shape["hidden_size"] * dtype_b + TOKEN_ID_BYTES
    hs_bytes = tokens * per_token + samples * HEADER_BYTES
    free = free if free is not None else free_bytes(cfg.run_dir)
    tps = tokens_per_s if tokens_per_s is not None else measured_tokens_per_s(cfg)
    throughput_source = "given" if tokens_per_s is not None else "measured by this run's extract"
    return {
        "target": {**shape, "layer_ids": ids},
        "samples": samples,
        "tokens": tokens,
        "token_source": token_source,
        "bytes_per_token": per_token,
        "hidden_state_bytes": hs_bytes,
        "runs_volume": str(cfg.run_dir),
        "free_bytes": free,
        "disk_sufficient": hs_bytes * DISK_MARGIN <= free,
        "extract_tokens_per_s": tps,
        "extract_seconds_estimate": round(tokens / tps, 1) if tps else None,
        "throughput_source": throughput_source if tps else None,
        "draft": draft_size(shape, len(ids), cfg.vocab.draft_vocab_size, cfg.train.num_layers, dtype_b),
        "notes": notes,
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min"


def render(p: dict) -> str:
    t, d = p["target"], p["draft"]
    lines = [
        f"target: {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}, "
        f"heads {t['num_attention_heads']}/{t['num_key_value_heads']} x {t['head_dim']}, intermediate {t['intermediate_size']}; "
        f"layer ids {t['layer_ids']} (vLLM convention)",
        f"samples: {p['samples']:,}   tokens: {p['tokens']:,} ({p['token_source']})",
        f"hidden states: {p['bytes_per_token']:,} B/token -> {human(p['hidden_state_bytes'])} ({p['hidden_state_bytes']:,} B)",
        f"runs volume: {p['runs_volume']}: {human(p['free_bytes'])} free -> "
        + ("enough" if p["disk_sufficient"] else "NOT ENOUGH (extract will refuse; extract.allow_insufficient_disk=true overrides)"),
        "extraction time: "
        + (f"{duration(p['extract_seconds_estimate'])} at {p['extract_tokens_per_s']:,} tokens/s per engine ({p['throughput_source']})"
           if p["extract_seconds_estimate"] is not None else "no measured throughput yet (run extract once, or a shard)"),
        f"draft (EAGLE-3, speculators 0.9.0 shape): {d['total_params']:,} params "
        f"({d['trainable_params']:,} trainable), weights {human(d['weights_bytes'])}, checkpoint {human(d['checkpoint_bytes'])}, "
        f"training state ~{human(d['training_state_bytes_estimate'])} (AdamW mixed precision)",
    ]
    lines += [f"    {k}: {v:,}" for k, v in d["params"].items()]
    lines += [f"note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def load_target_conf(cfg: Config, path: str | None = None) -> dict:
    from .manifest import StepError

    p = Path(path) if path else cfg.model_path / "config.json"
    if not p.exists():
        raise StepError(f"no target config at {p}: run `make model` first, or pass --target-config <config.json>")
    return json.loads(p.read_text())


def main(cfg: Config, target_config: str | None = None, conversations: int | None = None,
         tokens_per_sample: float | None = None, tokens_per_s: float | None = None) -> dict:
    p = plan(cfg, load_target_conf(cfg, target_config), conversations=conversations, tokens_per_sample=tokens_per_sample,
             tokens_per_s=tokens_per_s)
    print(render(p))
    return p


# ---------------------------------------------------------------- the check `extract` makes
def disk_check(cfg: Config, needed: int, out: Path) -> str | None:
    """None when the volume holds `needed` more bytes (with margin), else the refusal message."""
    free = free_bytes(out)
    if needed * DISK_MARGIN <= free:
        return None
    return (
        f"not enough disk for the hidden states: {human(needed)} ({needed:,} B) to write + 2 % margin, "
        f"{human(free)} ({free:,} B) free on the volume of {out}. Free space, point run.runs_dir at a larger volume, "
        f"shard the extraction (--shard i/n over several volumes), or, for a streaming/partial run, "
        f"--set extract.allow_insufficient_disk=true"
    )
