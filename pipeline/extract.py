"""`extract` step: hidden states of every prepared sample through vLLM's `extract_hidden_states`.

The step starts a vLLM server (extract_hidden_states speculative method + a hidden-states KV connector
that writes one safetensors file per request), sends each sample's token ids as a prompt with
max_tokens=1, checks the file the server wrote (shape, token ids) and moves it to its final name with
an atomic rename. The server is always stopped, also on error or Ctrl-C.

Resumable: a sample whose final file already exists with a valid header is not redone; files are
complete or absent (the server writes into a staging folder; only checked files are renamed in).
Output: runs/<run>/extract/<split>/hs_<i>.safetensors, hidden_states.json, digests.json, server.log.

The step's outputs_hash covers every file's sha256 (digests.json, read back once per file written and
kept while size, mtime and inode match), so a re-extraction that changes any byte -- a --force rerun after a vLLM
upgrade, files deleted and redone -- changes it, and verify and every later step run again instead of
trusting their results for other data.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .config import Config, repo_relative
from .hidden_states import DIGESTS, META, check_header, content_digests, file_name
from .layers import CONVENTION, LayerIdError, default_layer_ids, num_layers, validate
from .manifest import StepError, sha256_json, stack_description

SPLITS = ("train", "eval")


def resolve_layer_ids(cfg: Config) -> tuple[list[int], int, int]:
    """(layer ids in vLLM convention, number of decoder layers N, hidden size) for the target."""
    conf = json.loads((cfg.model_path / "config.json").read_text())
    n = num_layers(conf)
    hidden = int(conf.get("text_config", conf)["hidden_size"])
    ids = list(cfg.extract.layer_ids) or default_layer_ids(n)
    try:
        return validate(ids, n), n, hidden
    except LayerIdError as e:
        raise StepError(f"{cfg.source_path}: {e}") from e


def has_native_extraction(stack: str) -> bool:
    """vLLM's extract_hidden_states method exists from 0.17 (PR #33736)."""
    major, minor = (int(x) for x in stack_description(stack)["VLLM_VERSION"].split(".")[:2])
    return (major, minor) >= (0, 17)


def load_samples(cfg: Config) -> list[tuple[str, int, list[int]]]:
    from datasets import load_from_disk

    samples = []
    for split in SPLITS:
        ds = load_from_disk(str(cfg.step_dir("prepare") / split))
        samples += [(split, i, list(map(int, row))) for i, row in enumerate(ds["input_ids"])]
    return samples


def parse_shard(text: str) -> tuple[int, int]:
    """"i/n" -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise StepError(f"--shard expects i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise StepError(f"--shard {text}: need 0 <= i < n")
    return i, n


def shard_of(samples: list, shard: tuple[int, int] | None) -> list:
    """Shard i of n: the samples whose position in the concatenated (train, eval) list is i mod n."""
    if shard is None:
        return list(samples)
    i, n = shard
    return [s for k, s in enumerate(samples) if k % n == i]


def fragment_name(shard: tuple[int, int]) -> str:
    return f"{shard[0]}-of-{shard[1]}.json"


def extract_samples(cfg: Config, todo, out: Path, layer_ids: list[int], hidden: int, staging: Path) -> dict:
    """Write out/<split>/hs_<i>.safetensors for every (split, i, ids) in todo; returns timing stats.

    The one place that picks the engine (tests replace it with a fake that writes correct files).
    """
    from .engines.vllm_offline import cpu_only
    from .engines.vllm_server import VllmServer, VllmServerError, extraction_server_args, worker_in_engine_core

    stats = {"server_start_s": 0.0, "extract_s": 0.0, "tokens_extracted": 0}
    if cfg.extract.engine == "hf":
        # transformers on the GPU/CPU where vLLM is absent: same files, checked the same way by verify.
        from .engines.hf_engine import extract_hf

        stats.update(extract_hf(cfg, todo, out, layer_ids, hidden))
        return stats
    if not has_native_extraction(cfg.run.stack):
        # vLLM < 0.17 has no extract_hidden_states: the stack's patched speculators 0.3.0 generator.
        from .engines.legacy_generator import extract_legacy

        stats.update(extract_legacy(cfg, todo, out, layer_ids, hidden))
        return stats
    layout, layout_env = worker_in_engine_core(cfg.engine.llm_kwargs())  # CPU-only hosts: one process fewer
    env = {**os.environ, **layout_env}
    extra = (["--trust-remote-code"] if cfg.model.trust_remote_code else []) + cfg.engine.cli_args() + layout
    args = extraction_server_args(
        cfg.model_path, layer_ids, staging, cfg.model.max_model_len, dtype=cfg.model.dtype,
        on_cpu=cpu_only(), extra=extra, max_num_batched_tokens=cfg.model.max_model_len * cfg.extract.concurrency,
    )
    t0 = time.time()
    log = out / ("server.log" if staging.name == ".staging" else f"server{staging.name.removeprefix('.staging')}.log")
    try:
        with VllmServer(args, log_path=log, env=env,
                        startup_timeout=cfg.extract.startup_timeout_s) as server:
            stats["server_start_s"] = round(time.time() - t0, 1)
            t1 = time.time()
            stats["tokens_extracted"] = _extract_all(server, cfg, todo, out, len(layer_ids), hidden)
            stats["extract_s"] = round(time.time() - t1, 1)
    except VllmServerError as e:
        raise StepError(f"extraction server failed: {e}") from e
    return stats


def run(cfg: Config, out: Path, shard: tuple[int, int] | None = None) -> dict:
    """Extract every sample, or with `shard=(i, n)` only shard i of n (pipeline.extract.shard_of).

    A shard writes shards/<i>-of-<n>.json; the step's result (and so its manifest) is complete only
    when every sample of every split has its file; otherwise the result says {"incomplete": ...}.
    """
    from .plan import disk_check, file_bytes

    layer_ids, n, hidden = resolve_layer_ids(cfg)
    all_samples = load_samples(cfg)
    samples = shard_of(all_samples, shard)
    meta = {
        "layer_ids": layer_ids,
        "convention": CONVENTION,
        "convention_doc": "id k = residual stream entering decoder layer k; id N = final pre-norm state",
        "num_hidden_layers": n,
        "hidden_size": hidden,
        "dtype": cfg.model.dtype,
        "model": repo_relative(cfg.model_path),  # the same in a container and in the venv
        "precision": cfg.model.precision,
        "format": {"hidden_states": "[T, len(layer_ids), H]", "token_ids": "[T]"},
    }
    known = _known_digests(out)  # before anything below deletes shard records that carry them
    old_meta = out / META
    if old_meta.exists() and json.loads(old_meta.read_text())["layer_ids"] != layer_ids:
        # Files from other layer ids must not be mixed in: start over.
        for split in SPLITS:
            shutil.rmtree(out / split, ignore_errors=True)
        shutil.rmtree(out / "shards", ignore_errors=True)
    # An engine's unfinished writes (verify would call them stray): all of them, or with --shard only this
    # shard's own (another shard running now may be writing the others).
    ours = None if shard is None else {f".{file_name(i)}.tmp" for _, i, _ in samples}
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        for tmp in (out / split).glob("*.tmp"):
            if ours is None or tmp.name in ours:
                tmp.unlink(missing_ok=True)
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    if shard is None:
        # One process does everything: fragments of earlier sharded attempts no longer describe the output.
        shutil.rmtree(out / "shards", ignore_errors=True)

    todo, reused = [], 0
    for split, i, ids in samples:
        final = out / split / file_name(i)
        if final.exists() and check_header(final, len(ids), len(layer_ids), hidden) is None:
            reused += 1
        else:
            final.unlink(missing_ok=True)
            todo.append((split, i, ids))
    where = f"shard {shard[0]}/{shard[1]}: " if shard else ""
    print(f"[extract] {where}{len(samples)} samples, {reused} already extracted, {len(todo)} to do; layer ids {layer_ids} ({CONVENTION})")

    needed = sum(file_bytes(len(ids), len(layer_ids), hidden, cfg.model.dtype) for _, _, ids in todo)
    refusal = disk_check(cfg, needed, out) if todo else None
    if refusal and not cfg.extract.allow_insufficient_disk:
        raise StepError(refusal)
    if refusal:
        print(f"[extract] WARNING (extract.allow_insufficient_disk = true): {refusal}")

    # One staging folder per shard: shards may run at the same time on a shared volume.
    staging = out / (".staging" if shard is None else f".staging-{shard[0]}-of-{shard[1]}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    stats = {"server_start_s": 0.0, "extract_s": 0.0, "tokens_extracted": 0}
    started = time.time()
    try:
        if todo:
            stats.update(extract_samples(cfg, todo, out, layer_ids, hidden, staging))
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    from .manifest import write_json_atomic

    mine = content_digests(out, [f"{split}/{file_name(i)}" for split, i, _ in samples], known)
    if shard is not None:
        (out / "shards").mkdir(exist_ok=True)
        write_json_atomic(out / "shards" / fragment_name(shard), {
            "shard": list(shard),
            "fingerprint": (out / ".fingerprint").read_text() if (out / ".fingerprint").exists() else None,
            "samples": [[split, i] for split, i, _ in samples],
            "tokens": sum(len(ids) for _, _, ids in samples),
            "reused_from_earlier_run": reused,
            "extracted_now": len(todo),
            "seconds": round(time.time() - started, 1),
            **stats,
            "digests": mine,
        })
        missing = [(split, i) for split, i, ids in all_samples
                   if check_header(out / split / file_name(i), len(ids), len(layer_ids), hidden) is not None]
        if missing:
            return {"incomplete": f"shard {shard[0]}/{shard[1]} done; {len(missing)} of {len(all_samples)} samples "
                                  f"still missing (other shards), e.g. {missing[0][0]}/{file_name(missing[0][1])}"}
        # Every file is there, but the step is complete only when every shard has recorded its samples (verify
        # checks that the records cover every sample once); then the shard that completes the set finishes.
        absent = [k for k in range(shard[1]) if not (out / "shards" / fragment_name((k, shard[1]))).exists()]
        if absent:
            return {"incomplete": f"shard {shard[0]}/{shard[1]} done; no record yet from shard(s) "
                                  f"{', '.join(f'{k}/{shard[1]}' for k in absent)} (run them: their files are "
                                  f"there, so they only record them)"}
        # The last shard to finish writes the step's manifest; its numbers cover every fragment.
        frags = [json.loads(p.read_text()) for p in sorted((out / "shards").glob("*.json"))]
        stats = {k: round(sum(f.get(k, 0) for f in frags), 1) for k in ("server_start_s", "extract_s", "tokens_extracted")}
        stats["shards"] = [f"{f['shard'][0]}/{f['shard'][1]}" for f in frags]
        reused = len(all_samples) - sum(f["extracted_now"] for f in frags)

    files = sorted(p for split in SPLITS for p in (out / split).glob("hs_*.safetensors"))
    nbytes = sum(p.stat().st_size for p in files)
    tokens = sum(len(ids) for _, _, ids in all_samples)
    names = [str(p.relative_to(out)) for p in files]
    # this run's own hashes are current (taken after its last write); only other shards' files and strays are
    # looked up (and read where their records cannot be trusted)
    others = [name for name in names if name not in mine]
    digests = {**{name: mine[name] for name in names if name in mine},
               **(content_digests(out, others, _known_digests(out)) if others else {})}
    write_json_atomic(out / DIGESTS, digests)
    listing = [(name, digests[name]["size"], digests[name]["sha256"]) for name in names]
    extracted_now = len(todo) if shard is None else len(all_samples) - reused
    return {
        "summary": {
            "layer_ids": layer_ids,
            "layer_id_convention": CONVENTION,
            "engine": cfg.extract.engine,
            "precision": cfg.model.precision,
            "samples": len(all_samples),
            "reused_from_earlier_run": reused,
            "extracted_now": extracted_now,
            "tokens": tokens,
            "bytes": nbytes,
            "bytes_per_token": round(nbytes / max(tokens, 1), 1),
            **stats,
            "tokens_per_s": round(stats["tokens_extracted"] / stats["extract_s"], 1) if stats["extract_s"] else None,
        },
        # names, sizes and content hashes: any changed byte changes it (and reruns verify and what follows)
        "outputs_hash": sha256_json({"meta": meta, "files": listing}),
    }


def _known_digests(out: Path) -> dict[str, dict]:
    """Content hashes recorded earlier (digests.json and shard records); content_digests checks they are current.
    Only a cache: an unreadable record costs a re-read of its files, never a wrong hash."""
    known: dict[str, dict] = {}
    records = [out / DIGESTS] + (sorted((out / "shards").glob("*.json")) if (out / "shards").is_dir() else [])
    for path in records:
        try:
            d = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            continue
        d = d.get("digests", {}) if path.parent.name == "shards" else d
        known.update(d if isinstance(d, dict) else {})
    return known


def _extract_all(server, cfg: Config, todo, out: Path, num_ids: int, hidden: int) -> int:
    import httpx
    from tqdm import tqdm

    from .engines.vllm_server import request_hidden_states

    def one(item):
        split, i, ids = item
        path = Path(request_hidden_states(client, server.base_url, str(cfg.model_path), ids, request_id=f"{split}-{i}"))
        reason = check_header(path, len(ids), num_ids, hidden)
        if reason is None:
            reason = _check_tokens(path, ids)
        if reason:
            path.unlink(missing_ok=True)
            raise StepError(f"sample {split}/{i}: the server's hidden-state file is wrong: {reason}")
        os.replace(path, out / split / file_name(i))
        return len(ids)

    tokens = 0
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(cfg.extract.concurrency) as pool:
        futures = [pool.submit(one, item) for item in todo]
        try:
            with tqdm(total=sum(len(x[2]) for x in todo), unit="tok", desc="extract") as bar:
                for fut in as_completed(futures):
                    n = fut.result()
                    tokens += n
                    bar.update(n)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return tokens


def _check_tokens(path: Path, ids: list[int]) -> str | None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        got = f.get_tensor("token_ids").tolist()
    return None if got == ids else "token_ids differ from the prompt"


def forget_failed(cfg: Config) -> int:
    """`extract --redo-failed`: delete the files verify failed (runs/<run>/verify/failed.json) and the step's
    manifest, so the next extract run redoes exactly those and reuses every other file. A listed file that changed
    since verify read it (its sha256 differs) is kept: it is not the file verify judged."""
    from .manifest import MANIFEST, sha256_file
    from .verify import FAILED

    record = cfg.step_dir("verify") / FAILED
    if not record.exists():
        raise StepError(f"--redo-failed: {record} does not exist; it is written when verify fails "
                        f"(run `python -m pipeline verify --config {cfg.source_path}` first)")
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise StepError(f"--redo-failed: {record} is not verify's failure record ({e}); rerun verify") from None
    out = cfg.step_dir("extract")
    deleted = kept = 0
    for name, entry in sorted(files.items()):
        split, _, fname = name.partition("/")
        if split not in SPLITS or "/" in fname or not fname.startswith("hs_"):
            raise StepError(f"--redo-failed: {record} names {name!r}, which is not an extracted file; rerun verify")
        path = out / name
        if not path.exists():
            continue  # missing: extract redoes it anyway
        if not entry.get("sha256") or sha256_file(path) != entry["sha256"]:
            print(f"[extract] --redo-failed: {name} is not the file verify failed (changed or created since); "
                  f"kept, verify judges it again")
            kept += 1
            continue
        path.unlink()
        deleted += 1
    (out / MANIFEST).unlink(missing_ok=True)
    print(f"[extract] --redo-failed: {deleted} file(s) verify failed deleted, to be extracted again"
          + (f"; {kept} changed since, kept" if kept else ""))
    return deleted


def forget_shard(cfg: Config, out: Path, shard: tuple[int, int]) -> None:
    """Delete shard i/n's files and fragment (--force on one shard redoes only that shard)."""
    for split, i, _ in shard_of(load_samples(cfg), shard):
        (out / split / file_name(i)).unlink(missing_ok=True)
    (out / "shards" / fragment_name(shard)).unlink(missing_ok=True)
