"""Run speculators' own `train` CLI in this process, with its metrics also written to a JSONL file.

`python -m pipeline.engines.speculators_train --metrics FILE -- <speculators train args>` (or under
torchrun for several processes). speculators logs a dict per step to the "speculators.metrics" logger
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


def main(argv: list[str]) -> None:
    from ..env import setup_env

    setup_env()
    if "--" not in argv or argv[0] != "--metrics":
        sys.exit("usage: python -m pipeline.engines.speculators_train --metrics FILE -- <speculators train args>")
    metrics_path = argv[1]
    train_args = argv[argv.index("--") + 1:]
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    import speculators.train.cli as cli

    original = cli.setup_metric_logger

    def setup_metric_logger(*a, **kw):  # speculators reconfigures logging; attach afterwards
        original(*a, **kw)
        logging.getLogger("speculators.metrics").addHandler(JsonlHandler(metrics_path))

    cli.setup_metric_logger = setup_metric_logger
    train_main(TrainConfig.resolve(train_args))


if __name__ == "__main__":
    main(sys.argv[1:])
