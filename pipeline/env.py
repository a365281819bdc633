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
