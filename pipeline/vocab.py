"""`vocab` step: the draft vocabulary and its maps to and from the target vocabulary.

Token frequencies are counted over assistant (loss-masked) tokens of the training split only. The
maps are built by speculators' own `build_vocab_mappings_from_distribution` (top-k by frequency, ties by
id, padded with the lowest unseen ids, sorted), so they mean exactly what its trainer and vLLM expect:
  d2t[i]  offset: target id = draft id i + d2t[i]
  t2d[j]  True when target id j is in the draft vocabulary
Outputs: d2t.npy, t2d.npy, token_freq.pt, vocab.json (sizes, coverage, hashes).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .config import Config
from .manifest import StepError, sha256_file


def target_vocab_size(model_dir: Path) -> int:
    """The target's vocabulary size from its config.json (multimodal wrappers nest it in text_config)."""
    from .plan import text_config

    return int(text_config(json.loads((model_dir / "config.json").read_text()))["vocab_size"])


def token_frequencies(dataset) -> Counter:
    freq: Counter = Counter()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        freq.update(t for t, m in zip(ids, mask) if m)
    return freq


def coverage(freq: Counter, selected: set[int]) -> float:
    total = sum(freq.values())
    return sum(n for t, n in freq.items() if t in selected) / total if total else 0.0


def run(cfg: Config, out: Path) -> dict:
    import numpy as np
    import torch
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    target_vocab = target_vocab_size(cfg.model_path)
    size = cfg.vocab.draft_vocab_size
    if size > target_vocab:
        raise StepError(
            f"{cfg.source_path}: vocab.draft_vocab_size = {size} is larger than the target vocabulary "
            f"({target_vocab} tokens in {cfg.model_path}/config.json); choose at most {target_vocab}"
        )
    prep = cfg.step_dir("prepare")
    freq = token_frequencies(load_from_disk(str(prep / "train")))
    if not freq:
        raise StepError(f"{prep}/train has no assistant (loss-masked) tokens; nothing to build a draft vocabulary from")
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), size, target_vocab)
    selected = set((torch.arange(size) + d2t).tolist())
    if len(selected) != size or not bool(t2d[list(selected)].all()) or int(t2d.sum()) != size:
        raise StepError("internal error: d2t and t2d disagree")  # guards the offset semantics
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    torch.save(dict(freq), out / "token_freq.pt")
    eval_freq = token_frequencies(load_from_disk(str(prep / "eval")))
    info = {
        "draft_vocab_size": size,
        "target_vocab_size": target_vocab,
        "distinct_assistant_tokens": len(freq),
        "assistant_tokens": sum(freq.values()),
        "coverage_train": round(coverage(freq, selected), 4),
        "coverage_eval": round(coverage(eval_freq, selected), 4) if eval_freq else None,
        "d2t_sha256": sha256_file(out / "d2t.npy"),
        "t2d_sha256": sha256_file(out / "t2d.npy"),
        "semantics": "target_id = draft_id + d2t[draft_id]; t2d = bool mask over target ids",
    }
    (out / "vocab.json").write_text(json.dumps(info, indent=2) + "\n")
    return {"summary": info}
