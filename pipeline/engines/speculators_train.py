"""Run speculators' own `train` CLI in this process, with its metrics also written to a JSONL file.

`python -m pipeline.engines.speculators_train --metrics FILE [--stream JSON] -- <speculators train args>` (or
under torchrun for several processes). `--stream '{"model_path": ..., "layer_ids": [...], "dtype": ...}'` trains
on hidden states computed on the fly (pipeline/engines/stream_states.py) instead of the data folder's files.
speculators logs a dict per step to the "speculators.metrics" logger
({"train": {...}, "epoch", "global_step"} and {"val": {...}, "epoch"}); a handler appends each one as
a JSON line, which the train step turns into a CSV-free JSONL log and a PNG of the curves. Only rank 0
writes. On CPU the patched speculators (patches/speculators/<version>) picks the CPU device.
"""
from __future__ import annotations

import json
import logging
import os
import sys


class JsonlHandler(logging.Handler):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, dict) or int(os.environ.get("RANK", "0")) != 0:
            return
        row = {"step": getattr(record, "step", None), **record.msg}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def float32_newton_schulz_on_cpu() -> bool:
    """On the CPU, run Muon's Newton-Schulz orthogonalization in float32 instead of torch's hard-coded bf16.

    torch.optim.Muon (speculators' default optimizer) casts every 2-D gradient to bf16 for its five Newton-Schulz
    iterations. A CPU without bf16 instructions (AVX2 only, e.g. AMD EPYC Zen 3) emulates bf16 matmuls ~90x slower
    than fp32: the tiny config spent 28 s of a 30 s step there (NOTES "CPU dtype"). The same iteration in float32
    is cheaper and at least as exact. GPUs keep torch's own. Returns whether the replacement was installed.
    """
    import torch

    if torch.cuda.is_available():
        return False
    import torch.optim._muon as muon

    def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
        # torch 2.13's _zeropower_via_newtonschulz with the bf16 cast removed (the same iteration; out of place:
        # grad.float() may be the momentum buffer itself)
        if ns_steps >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        if len(grad.shape) != 2:
            raise ValueError("Input tensor gradient must be a 2D matrix")
        a, b, c = ns_coefficients
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    muon._zeropower_via_newtonschulz = newton_schulz_float32
    return True


def main(argv: list[str]) -> None:
    from ..env import setup_env

    setup_env()
    if "--" not in argv or argv[0] != "--metrics":
        sys.exit("usage: python -m pipeline.engines.speculators_train --metrics FILE [--stream JSON] -- "
                 "<speculators train args>")
    metrics_path = argv[1]
    train_args = argv[argv.index("--") + 1:]
    stream = None
    if "--stream" in argv[:argv.index("--")]:  # train.hidden_states = "stream": the target runs beside the draft
        stream = json.loads(argv[argv.index("--stream") + 1])
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    import speculators.train.cli as cli

    original = cli.setup_metric_logger

    def setup_metric_logger(*a, **kw):  # speculators reconfigures logging; attach afterwards
        original(*a, **kw)
        logging.getLogger("speculators.metrics").addHandler(JsonlHandler(metrics_path))

    cli.setup_metric_logger = setup_metric_logger
    if float32_newton_schulz_on_cpu():
        import warnings

        # CPU training passes --hidden-states-dtype float32 (pipeline/train.py), which speculators hands to
        # torch.autocast: CPU autocast takes bf16/fp16 only and turns itself off, which is the point; not a warning
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    if stream:
        from .stream_states import install

        install(**stream)
    train_main(TrainConfig.resolve(train_args))


if __name__ == "__main__":
    main(sys.argv[1:])
