"""`verify` step: the extracted hidden states are what they claim to be, in every file.

1. Structure, every file: shape [T, L, H] with L = number of layer ids, token ids equal to the prepared sample,
   all values finite, dtype as configured; every sample exactly once (coverage, shard records).
2. Content, every file (pipeline/verify_content.py): no all-zero token rows; the first verify.prefix_tokens
   positions against a transformers forward pass over those tokens (cosine and norm per layer); the target's own
   head on the final pre-norm state predicts the prepared next tokens as often as on clean data; no two files
   with the same states for different tokens.
3. Parity on a seeded sample of files (verify.parity_samples; 0 = all): an independent transformers forward
   pass over all tokens; per layer, the mean per-token cosine must be at least verify.min_cosine (and the norm
   within verify.max_norm_deviation) at the HF index the layer-id convention prescribes. These files also
   calibrate the head check.
Any failure makes the step fail (no manifest), listing every bad file with the check that caught it in
problems.txt and failed.json; `python -m pipeline extract --redo-failed` re-extracts exactly those files. A file
only the head check flags gets the full parity: if its states are right, it is a warning (the tokens are what the
target would not have produced), listed in the summary, not a failure.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from .config import Config
from .extract import SPLITS
from .hidden_states import META, file_name
from .manifest import StepError, require_manifest, write_json_atomic

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MAX_ESCALATIONS = 64  # head-flagged files given the full parity; beyond that many, something systematic is wrong
FAILED = "failed.json"  # {"extract_outputs_hash", "files": {name: {"sha256", "problems": [{"check", "reason"}]}}}


def parity_sample(cfg: Config, names: list[str]) -> list[str]:
    """The seeded sample of file names that get the full parity check (and calibrate the head check)."""
    k = cfg.verify.parity_samples
    return list(names) if k <= 0 or k >= len(names) else random.Random(cfg.run.seed).sample(list(names), k)


def run(cfg: Config, out: Path) -> dict:
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(cfg, out)
    finally:
        torch.set_num_threads(threads)  # one_torch_thread_beside_readers may have lowered it


def one_torch_thread_beside_readers(device) -> int:
    """With the reference on a GPU, the main thread's CPU work (each file's cosines and copies) runs on one torch
    thread. Beside verify's reader threads, torch's default team (a thread per core) oversubscribed the cores: 81 ms
    a file on the H200 against 1.14 ms on one thread (`tests/bench/verify_main_thread.py --device cuda --contend`,
    NOTES "Session 26"). On the CPU the reference's own forward passes need the team: unchanged. Returns the
    threads the checks run with."""
    import torch

    if device.type == "cuda":
        torch.set_num_threads(1)
    return torch.get_num_threads()


def _run(cfg: Config, out: Path) -> dict:
    from safetensors import safe_open
    from tqdm import tqdm

    from .engines.hf_reference import hidden_states, load_model
    from .verify_content import ContentChecks, compare_states, norm_problems

    src = cfg.step_dir("extract")
    extract_manifest = require_manifest(cfg, "extract")
    meta = json.loads((src / META).read_text())
    layer_ids, hidden = meta["layer_ids"], meta["hidden_size"]
    samples = load_prepared(cfg)  # name -> (ids, loss mask)
    names = list(samples)
    general = [p for p in coverage_problems(src, split_indices(names)) if not p.endswith(": missing")]  # missing: per file
    sample = set(parity_sample(cfg, names))

    model = load_model(cfg.model_path, cfg.model.dtype, cfg.model.trust_remote_code, cfg.verify.device)
    checks = ContentChecks(model, layer_ids, meta["num_hidden_layers"], cfg.verify.prefix_tokens,
                           cfg.verify.head_positions, cfg.verify.prefix_min_cosine, cfg.verify.max_norm_deviation,
                           cfg.run.seed, cfg.verify.head_fraction)
    torch_threads = one_torch_thread_beside_readers(model.device)
    structural: dict[str, list[str]] = {}
    read_stat: dict[str, tuple | None] = {}  # (size, mtime, inode) when verify read the file
    t0 = time.time()
    workers = read_workers(cfg)
    files = iter(tqdm(read_ahead(src, names, samples, len(layer_ids), hidden, cfg.model.dtype, workers),
                      total=len(names), desc=f"verify files ({workers} readers)", unit="file"))
    read_wait = 0.0  # seconds the checks waited for the readers: ~0 when reading is not what limits verify
    while True:
        t = time.time()
        item = next(files, None)
        read_wait += time.time() - t
        if item is None:
            break
        name, stat, found, hs, facts = item
        read_stat[name] = stat
        if found:
            structural[name] = found
        else:
            ids, mask = samples[name]
            checks.add(name, hs, ids, mask, calibrate=name in sample, facts=facts)
    content_s = time.time() - t0

    per_layer: dict[int, list[float]] = {lid: [] for lid in layer_ids}
    parity, parity_problems, parity_passed = [], {}, set()

    def full_parity(name: str) -> list[str]:
        """Every position of one file against transformers; the problems found (a row goes to parity.json)."""
        ids = samples[name][0]
        with safe_open(str(src / name), "pt") as f:
            got = f.get_tensor("hidden_states").float()
        cos, ratio = compare_states(got, hidden_states(model, ids, layer_ids).float())  # [T, L], [L]
        row = {"file": name, "tokens": len(ids)}
        bad = []
        for j, lid in enumerate(layer_ids):
            c = float(cos[:, j].mean())
            per_layer[lid].append(c)
            row[f"cos_{lid}"] = round(c, 6)
            row[f"min_cos_{lid}"] = round(float(cos[:, j].min()), 6)
            row[f"log_norm_ratio_{lid}"] = round(float(ratio[j]), 5)
            if c < cfg.verify.min_cosine:
                bad.append(f"layer id {lid}: mean cosine {c:.4f} < {cfg.verify.min_cosine} against transformers "
                           f"(wrong layer, wrong convention, misaligned tokens or corrupted values)")
        bad += norm_problems(ratio.tolist(), layer_ids, cfg.verify.max_norm_deviation)
        parity.append(row)
        return bad

    for name in tqdm([n for n in names if n in sample and n not in structural], desc="parity vs transformers", unit="file"):
        bad = full_parity(name)
        if bad:
            parity_problems[name] = bad
        else:
            parity_passed.add(name)
    t1 = time.time()
    content = checks.finish(parity_passed)
    # A file only the head check flags may hold the right states for tokens the target would not have produced
    # (an answer it does not reproduce): the full parity decides. Right states: a data warning, not a failure.
    head_only = [n for n, found in checks.findings.items() if {f.check for f in found} == {"head"}]
    unpredicted = [n for n in head_only if n in parity_passed]  # the sample's full parity already decided
    suspects = [n for n in head_only if n not in parity_passed and n not in parity_problems][:MAX_ESCALATIONS]
    for name in tqdm(suspects, desc="parity on head-flagged files", unit="file", disable=not suspects):
        bad = full_parity(name)
        if bad:
            parity_problems[name] = bad
        else:
            unpredicted.append(name)
    for name in unpredicted:
        del checks.findings[name]
    if "head" in content and content["head"].get("covered"):
        content["head"]["flagged_then_parity_passed"] = sorted(unpredicted)[:50]
        content["head"]["flagged_then_parity_passed_count"] = len(unpredicted)
        content["head"]["flagged_files_given_full_parity"] = len(suspects)
    if unpredicted:
        print(f"[verify] WARNING: {len(unpredicted)} file(s) hold the right states (full parity passed) for tokens the "
              f"target's head does not predict (an answer it would not have produced, e.g. re-tokenized or not "
              f"greedy): {', '.join(unpredicted[:5])}{' ...' if len(unpredicted) > 5 else ''} (verify summary "
              f"checks.head.flagged_then_parity_passed)")
    content_s += time.time() - t1
    (out / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")

    failed: dict[str, list[dict]] = {}
    for name in names:
        rows = ([{"check": "structure", "reason": r} for r in structural.get(name, [])]
                + [{"check": f.check, "reason": f.reason} for f in checks.findings.get(name, [])]
                + [{"check": "parity", "reason": r} for r in parity_problems.get(name, [])])
        if rows:
            failed[name] = rows
    if failed or general:
        fail(cfg, src, out, extract_manifest, failed, general, read_stat)
    return {
        # What downstream steps depend on is the verified data itself.
        "outputs_hash": extract_manifest["outputs_hash"],
        "summary": {
            "files_checked": len(names),
            "tokens_checked": content["tokens"],
            "layer_ids": layer_ids,
            "layer_id_convention": meta["convention"],
            "parity_files": len(parity) - len(suspects),
            "min_mean_cosine_per_layer": {str(k): round(min(v), 6) for k, v in per_layer.items() if v},
            "threshold": cfg.verify.min_cosine,
            "checks": {k: v for k, v in content.items() if k not in ("files", "tokens")},
            "content_checks_s": round(content_s, 1),
            "read_workers": workers,
            "content_read_wait_s": round(read_wait, 1),
            "reference_device": str(model.device),
            "main_thread_torch_threads": torch_threads,
        }
    }


def read_workers(cfg: Config) -> int:
    return cfg.verify.read_workers or max(1, min(8, len(os.sched_getaffinity(0))))


def read_ahead(src: Path, names: list[str], samples: dict, num_ids: int, hidden: int, dtype: str, workers: int):
    """(name, stat, structural problems, states, FileFacts) per file, in `names` order: `workers` threads read
    and check files ahead of the caller (the disk read, the finite check and sha256 release the GIL; the caller's
    batched model work runs meanwhile). At most 2 x workers files wait in memory."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from .verify_content import file_facts

    def one(name: str):
        stat = file_stat(src / name)  # before the read: a file rewritten after it no longer matches
        found, hs = read_checked(src / name, samples[name][0], num_ids, hidden, dtype)
        return name, stat, found, hs, (None if found else file_facts(hs))

    if workers <= 1:
        yield from map(one, names)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="verify-read") as pool:
        pending = deque()
        for name in names:
            pending.append(pool.submit(one, name))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def file_stat(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def fail(cfg: Config, src: Path, out: Path, extract_manifest: dict, failed: dict, general: list[str],
         read_stat: dict) -> None:
    """Write problems.txt and failed.json (what `extract --redo-failed` redoes) and raise the step's error."""
    from .manifest import sha256_file

    def judged(name: str) -> str | None:
        """sha256 of the bytes verify judged: the file as it is now, if unchanged since verify read it."""
        now = file_stat(src / name)
        return sha256_file(src / name) if now is not None and now == read_stat.get(name) else None

    # --redo-failed deletes a file only while it still holds the bytes verify judged
    write_json_atomic(out / FAILED, {
        "extract_outputs_hash": extract_manifest["outputs_hash"],
        "files": {name: {"sha256": judged(name), "problems": rows} for name, rows in failed.items()},
        "other_problems": general,
    })
    lines = general + [f"{name} [{r['check']}] {r['reason']}" for name, rows in failed.items() for r in rows]
    (out / "problems.txt").write_text("\n".join(lines) + "\n")
    by_check: dict[str, int] = {}
    for rows in failed.values():
        for c in {r["check"] for r in rows}:
            by_check[c] = by_check.get(c, 0) + 1
    # one line per bad file (its checks and first reason); every reason is in problems.txt
    short = general[:10] + [
        f"{name}: {', '.join(dict.fromkeys(r['check'] for r in rows))} -- {rows[0]['reason']}"
        + (f" (+{len(rows) - 1} more)" if len(rows) > 1 else "") for name, rows in list(failed.items())[:30]]
    more = len(general) - min(len(general), 10) + len(failed) - min(len(failed), 30)
    shown = "\n  ".join(short + ([f"... and {more} more"] if more else []))
    counts = ", ".join(f"{c}: {n}" for c, n in sorted(by_check.items()))
    raise StepError(
        f"verify failed: {len(failed)} bad file(s) ({counts or 'none'}) and {len(general)} other problem(s) in {src} "
        f"(all listed in {out / 'problems.txt'} and {out / FAILED}):\n  {shown}\n"
        f"fix: find the cause, then `python -m pipeline extract --config {cfg.source_path} --redo-failed` "
        f"(or `make extract ARGS=--redo-failed`) re-extracts only these files; then run verify again"
    )


def load_prepared(cfg: Config) -> dict[str, tuple[list[int], list[int] | None]]:
    """{"<split>/hs_<i>.safetensors": (token ids, loss mask)} for every prepared sample, in order."""
    from datasets import load_from_disk

    out = {}
    for split in SPLITS:
        ds = load_from_disk(str(cfg.step_dir("prepare") / split))
        masks = ds["loss_mask"] if "loss_mask" in ds.column_names else [None] * len(ds)
        for i, (ids, mask) in enumerate(zip(ds["input_ids"], masks)):
            out[f"{split}/{file_name(i)}"] = (list(map(int, ids)), list(map(int, mask)) if mask is not None else None)
    return out


def split_indices(names: list[str]) -> list[tuple[str, int]]:
    """("train", 3) for "train/hs_3.safetensors": the (split, index) of each of load_prepared's names."""
    return [(n.split("/")[0], int(n.split("_")[1].split(".")[0])) for n in names]


def structural_problems(cfg: Config) -> tuple[list[str], list[tuple[Path, list[int]]], set[Path]]:
    """Coverage (every sample exactly once) and per-file checks without a model; (problems, (file, ids) list,
    broken files). The structural half of `run`, on its own."""
    from tqdm import tqdm

    src = cfg.step_dir("extract")
    meta = json.loads((src / META).read_text())
    layer_ids, hidden = meta["layer_ids"], meta["hidden_size"]
    samples = load_prepared(cfg)
    files = [(src / name, ids) for name, (ids, _) in samples.items()]
    # "missing" is reported by the per-file check below
    problems = [p for p in coverage_problems(src, split_indices(list(samples))) if not p.endswith(": missing")]
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
    return read_checked(path, ids, num_ids, hidden, dtype)[0]


def read_checked(path: Path, ids: list[int], num_ids: int, hidden: int, dtype: str):
    """(structural problems, hidden_states tensor or None): the file read once for every check."""
    from safetensors import safe_open

    from .verify_content import all_finite

    if not path.exists():
        return ["missing"], None
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            if keys != {"hidden_states", "token_ids"}:
                return [f"unexpected tensors {sorted(keys)}"], None
            hs = f.get_tensor("hidden_states")
            tok = f.get_tensor("token_ids")
    except Exception as e:  # safetensors raises several types for corrupt files
        return [f"unreadable ({type(e).__name__}: {e})"], None
    problems = []
    if list(hs.shape) != [len(ids), num_ids, hidden]:
        problems.append(f"shape {list(hs.shape)} != [T={len(ids)}, layers={num_ids}, H={hidden}]")
    if str(hs.dtype) != f"torch.{dtype}":
        problems.append(f"dtype {hs.dtype} != {dtype}")
    if tok.tolist() != ids:
        first = next((j for j, (a, b) in enumerate(zip(tok.tolist(), ids)) if a != b), min(len(tok), len(ids)))
        problems.append(f"token ids differ from the prepared sample (first difference at position {first})")
    if not all_finite(hs):
        problems.append("non-finite values (NaN/Inf)")
    return problems, hs
