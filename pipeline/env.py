"""Process environment for every step: caches and sockets inside the repo, CPU engine settings.

Called once by the CLI before vLLM, transformers or datasets are imported, so nothing is written to
/tmp or $HOME (vLLM's zmq sockets go to TMPDIR, compiled graphs to VLLM_CACHE_ROOT, datasets to HF_HOME).
"""
from __future__ import annotations

import os

from .config import REPO_ROOT

CACHE = REPO_ROOT / ".cache"


def setup_env() -> dict[str, str]:
    defaults = {
        "HF_HOME": str(CACHE / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
        "TMPDIR": str(CACHE / "tmp"),
        "MPLCONFIGDIR": str(CACHE / "matplotlib"),
        "TRITON_CACHE_DIR": str(CACHE / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "inductor"),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO_ROOT),
    }
    for k, v in defaults.items():
        if k == "PYTHONPATH" and os.environ.get(k):
            if str(REPO_ROOT) not in os.environ[k].split(os.pathsep):
                os.environ[k] = str(REPO_ROOT) + os.pathsep + os.environ[k]
            continue
        os.environ.setdefault(k, v)
    for k in ("HF_HOME", "VLLM_CACHE_ROOT", "TMPDIR", "MPLCONFIGDIR"):
        os.makedirs(os.environ[k], exist_ok=True)
    import tempfile

    tempfile.tempdir = os.environ["TMPDIR"]
    return {k: os.environ[k] for k in defaults}


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def slow_cpu_dtype(dtype: str, key: str, flags: set[str] | None = None) -> str | None:
    """Why `key = dtype` will crawl on this machine, or None: bf16 compute on a CPU-only host whose CPU has no bf16
    instructions (AVX2 only, e.g. AMD EPYC Zen 3). torch and vLLM emulate it there: a 1024x576x1536 matmul ran at
    1.2 GFLOP/s in bf16 against 108 in fp32 (NOTES.md, "CPU dtype"), and vLLM's prepare took 85 s per prompt."""
    if dtype != "bfloat16":
        return None
    flags = cpu_flags() if flags is None else flags
    if not flags or flags & BF16_FLAGS:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (f'{key} = "bfloat16" on a CPU without bf16 instructions (no {" or ".join(sorted(BF16_FLAGS))}): '
            f'torch and vLLM emulate bf16 here, about 90x slower than float32. Set {key} = "float32" '
            f'(the CPU configs do; NOTES.md, "CPU dtype").')
