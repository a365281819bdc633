"""One CLI for every step: `python -m pipeline <step> --config configs/<name>.toml`."""
from __future__ import annotations

import argparse
import signal
import sys

from .env import setup_env

STEPS = ["model", "prepare", "extract", "verify", "vocab", "train", "eval", "report"]


def parse_set(values: list[str]) -> dict:
    import tomllib

    out = {}
    for v in values:
        key, _, raw = v.partition("=")
        if not _ or "." not in key:
            sys.exit(f"--set expects section.key=value, got {v!r}")
        try:
            out[key] = tomllib.loads(f"x = {raw}")["x"]
        except tomllib.TOMLDecodeError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    ap.add_argument("step", choices=STEPS + ["all"], help="step to run ('all' runs every step in order)")
    ap.add_argument("--config", default="configs/smollm2-cpu.toml")
    ap.add_argument("--force", action="store_true", help="redo the step even if its manifest is complete")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    args = ap.parse_args(argv)
    # SIGTERM (docker stop, a scheduler, a test) unwinds like Ctrl-C, so engines are stopped and
    # no manifest is written for an unfinished step.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup_env()
    from .config import ConfigError, load_config
    from .manifest import StepError
    from .steps import run

    try:
        cfg = load_config(args.config, parse_set(args.set))
        for step in STEPS if args.step == "all" else [args.step]:
            run(cfg, step, force=args.force)
    except (ConfigError, StepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
