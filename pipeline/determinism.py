"""Determinism settings: the one place that sets them, and what the manifests record.

`apply(seed)` runs once in the CLI before any step:
  * environment for this process and every engine it starts (vLLM server, speculators, torchrun ranks):
      CUBLAS_WORKSPACE_CONFIG=:4096:8   cuBLAS picks deterministic reductions (needed by
                                        torch.use_deterministic_algorithms on CUDA >= 10.2)
      PYTHONHASHSEED=<seed>             hash order in child processes
  * seeds of python `random`, numpy and torch (all devices) in this process;
  * torch.use_deterministic_algorithms(True, warn_only=True): deterministic kernels where torch has
    them; a kernel without one warns instead of failing the step.
The steps pass the config seed on to the engines themselves (vLLM `seed`, speculators `--seed`).
EAGLE3_DETERMINISTIC=0 skips the torch switch (e.g. to measure its cost); the manifests say so.

Limits (NOTES.md): vLLM batches requests as they arrive, and on the CPU build bf16 kernels depend on
the batch shape, so extraction files are reproducible only within the tolerance
tests/test_scale.py measures; vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) is GPU-only and
not switched on here.
"""
from __future__ import annotations

import os

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
SWITCH = "EAGLE3_DETERMINISTIC"


def apply(seed: int) -> dict:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    import random

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)  # seeds every device too
        if enabled():
            torch.use_deterministic_algorithms(True, warn_only=True)
    except ImportError:
        pass
    return settings(seed)


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def settings(seed: int) -> dict:
    """What the manifests record: the seed and the determinism state of this process."""
    out = {
        "seed": seed,
        "deterministic_algorithms": None,
        "env": {k: os.environ.get(k) for k in [*ENV, "PYTHONHASHSEED", SWITCH, "VLLM_BATCH_INVARIANT"]},
    }
    try:
        import sys

        if "torch" in sys.modules:  # do not import torch just to record it
            torch = sys.modules["torch"]
            out["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
            out["deterministic_warn_only"] = torch.is_deterministic_algorithms_warn_only_enabled()
            out["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
    except Exception:
        pass
    return out
