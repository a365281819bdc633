"""`verify` step: the extracted hidden states are what they claim to be.

1. Every file: shape [T, L, H] with L = number of layer ids, token ids equal to the prepared sample,
   all values finite, dtype as configured.
2. Parity on a seeded sample of files (verify.parity_samples; 0 = all): an independent transformers
   forward pass over the same tokens; per layer, the mean per-token cosine similarity must be at least
   verify.min_cosine at the HF index the layer-id convention prescribes. A file shifted by one layer,
   or captured with another convention, fails here.
Any failure makes the step fail (no manifest), listing every bad file.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from .config import Config
from .extract import SPLITS
from .hidden_states import META, file_name
from .manifest import StepError, require_manifest

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def run(cfg: Config, out: Path) -> dict:
    import torch
    from datasets import load_from_disk
    from safetensors import safe_open
    from tqdm import tqdm

    src = cfg.step_dir("extract")
    extract_manifest = require_manifest(cfg, "extract")
    meta = json.loads((src / META).read_text())
    layer_ids = meta["layer_ids"]
    problems, files, broken = structural_problems(cfg)

    rng = random.Random(cfg.run.seed)
    k = cfg.verify.parity_samples
    sample = files if k <= 0 or k >= len(files) else rng.sample(files, k)
    sample = [f for f in sample if f[0] not in broken]  # already failed; parity needs a readable file
    from .engines.hf_reference import hidden_states, load_model

    model = load_model(cfg.model_path, cfg.model.dtype, cfg.model.trust_remote_code)
    per_layer: dict[int, list[float]] = {lid: [] for lid in layer_ids}
    parity = []
    for path, ids in tqdm(sample, desc="parity vs transformers", unit="file"):
        with safe_open(str(path), "pt") as f:
            got = f.get_tensor("hidden_states").float()
        ref = hidden_states(model, ids, layer_ids).float()
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)  # [T, L]
        row = {"file": str(path.relative_to(src)), "tokens": len(ids)}
        for j, lid in enumerate(layer_ids):
            c = float(cos[:, j].mean())
            per_layer[lid].append(c)
            row[f"cos_{lid}"] = round(c, 6)
            row[f"min_cos_{lid}"] = round(float(cos[:, j].min()), 6)
            if c < cfg.verify.min_cosine:
                problems.append(
                    f"{row['file']}: layer id {lid} mean cosine {c:.4f} < {cfg.verify.min_cosine} against transformers "
                    f"(wrong layer, wrong convention, misaligned tokens or corrupted values)"
                )
        parity.append(row)
    (out / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
    if problems:
        (out / "problems.txt").write_text("\n".join(problems) + "\n")
        shown = "\n  ".join(problems[:20])
        raise StepError(
            f"verify failed: {len(problems)} problem(s) in {src} (all listed in {out / 'problems.txt'}):\n  {shown}\n"
            f"fix: rerun `make extract` (invalid files are redone) after fixing the cause"
        )
    return {
        # What downstream steps depend on is the verified data itself.
        "outputs_hash": extract_manifest["outputs_hash"],
        "summary": {
            "files_checked": len(files),
            "parity_files": len(sample),
            "layer_ids": layer_ids,
            "layer_id_convention": meta["convention"],
            "min_mean_cosine_per_layer": {str(k): round(min(v), 6) for k, v in per_layer.items() if v},
            "threshold": cfg.verify.min_cosine,
        }
    }


def structural_problems(cfg: Config) -> tuple[list[str], list[tuple[Path, list[int]]], set[Path]]:
    """Coverage (every sample exactly once) and per-file checks; (problems, (file, ids) list, broken files)."""
    from datasets import load_from_disk
    from tqdm import tqdm

    src = cfg.step_dir("extract")
    meta = json.loads((src / META).read_text())
    layer_ids, hidden = meta["layer_ids"], meta["hidden_size"]
    files: list[tuple[Path, list[int]]] = []
    expected = []
    for split in SPLITS:
        ds = load_from_disk(str(cfg.step_dir("prepare") / split))
        for i, ids in enumerate(ds["input_ids"]):
            files.append((src / split / file_name(i), list(map(int, ids))))
            expected.append((split, i))
    # "missing" is reported by the per-file check below
    problems = [p for p in coverage_problems(src, expected) if not p.endswith(": missing")]
    broken = set()
    for path, ids in tqdm(files, desc="verify files", unit="file"):
        found = check_file(path, ids, len(layer_ids), hidden, cfg.model.dtype)
        problems += [f"{path.relative_to(src)}: {p}" for p in found]
        if found:
            broken.add(path)
    return problems, files, broken


def coverage_problems(src: Path, expected: list[tuple[str, int]]) -> list[str]:
    """Every sample appears exactly once: no missing file, no stray file in the split folders, and, for a
    sharded extraction, the shard fragments (shards/<i>-of-<n>.json) cover every sample exactly once."""
    problems = []
    want = {f"{split}/{file_name(i)}" for split, i in expected}
    have = set()
    for split in SPLITS:
        d = src / split
        if d.is_dir():
            have |= {f"{split}/{p.name}" for p in d.iterdir()}
    problems += [f"{f}: missing" for f in sorted(want - have)]
    problems += [f"{f}: stray file (no prepared sample has this name; delete it or rerun extract)"
                 for f in sorted(have - want)]
    shards = sorted((src / "shards").glob("*.json")) if (src / "shards").is_dir() else []
    if shards:
        seen: dict[tuple[str, int], list[str]] = {}
        counts = set()
        for p in shards:
            frag = json.loads(p.read_text())
            counts.add(frag["shard"][1])
            for split, i in frag["samples"]:
                seen.setdefault((split, i), []).append(p.name)
        if len(counts) > 1:
            problems.append(f"shards/: fragments of different shard counts {sorted(counts)} (mixed --shard i/n runs)")
        problems += [f"{split}/{file_name(i)}: claimed by several shards {names}"
                     for (split, i), names in sorted(seen.items()) if len(names) > 1]
        problems += [f"{split}/{file_name(i)}: in no shard fragment" for split, i in expected if (split, i) not in seen]
        problems += [f"{split}/{file_name(i)}: in shard fragment(s) {names} but not a prepared sample"
                     for (split, i), names in sorted(seen.items()) if (split, i) not in set(expected)]
    return problems


def check_file(path: Path, ids: list[int], num_ids: int, hidden: int, dtype: str) -> list[str]:
    """Structural checks of one file; returns the problems found (empty when fine)."""
    import torch
    from safetensors import safe_open

    if not path.exists():
        return ["missing"]
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            if keys != {"hidden_states", "token_ids"}:
                return [f"unexpected tensors {sorted(keys)}"]
            hs = f.get_tensor("hidden_states")
            tok = f.get_tensor("token_ids")
    except Exception as e:  # safetensors raises several types for corrupt files
        return [f"unreadable ({type(e).__name__}: {e})"]
    problems = []
    if list(hs.shape) != [len(ids), num_ids, hidden]:
        problems.append(f"shape {list(hs.shape)} != [T={len(ids)}, layers={num_ids}, H={hidden}]")
    if str(hs.dtype) != f"torch.{dtype}":
        problems.append(f"dtype {hs.dtype} != {dtype}")
    if tok.tolist() != ids:
        first = next((j for j, (a, b) in enumerate(zip(tok.tolist(), ids)) if a != b), min(len(tok), len(ids)))
        problems.append(f"token ids differ from the prepared sample (first difference at position {first})")
    if not torch.isfinite(hs.float()).all():
        problems.append("non-finite values (NaN/Inf)")
    return problems
