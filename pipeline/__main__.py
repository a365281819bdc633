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
    ap.add_argument("step", choices=STEPS + ["all", "plan"],
                    help="step to run ('all' runs every step in order; 'plan' prints what a run will cost)")
    ap.add_argument("--config", default="configs/smollm2-cpu.toml")
    ap.add_argument("--force", action="store_true", help="redo the step even if its manifest is complete")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    ap.add_argument("--shard", metavar="I/N", help="extract only: shard I of N (samples whose index %% N == I)")
    ap.add_argument("--redo-failed", action="store_true",
                    help="extract only: re-extract exactly the files the last verify failed (verify/failed.json)")
    plan = ap.add_argument_group("plan only")
    plan.add_argument("--target-config", help="the target's config.json (default: <model.path>/config.json)")
    plan.add_argument("--conversations", type=int, help="plan for this many samples instead of the prepared data")
    plan.add_argument("--tokens-per-sample", type=float, help="plan with this mean sample length (default seq_length/2)")
    plan.add_argument("--tokens-per-s", type=float, help="extraction throughput per engine for the time estimate "
                      "(default: the one this run's extract measured)")
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
        if args.step == "plan":
            from . import plan as planner

            planner.main(cfg, args.target_config, args.conversations, args.tokens_per_sample, args.tokens_per_s)
            return 0
        from .determinism import apply as apply_determinism
        from .extract import parse_shard

        apply_determinism(cfg.run.seed)
        shard = parse_shard(args.shard) if args.shard else None
        if shard and args.step != "extract":
            raise StepError("--shard applies to the extract step only")
        if args.redo_failed:
            if args.step != "extract" or shard or args.force:
                raise StepError("--redo-failed applies to the extract step only, without --shard or --force "
                                "(--force redoes every file)")
            from .extract import forget_failed

            forget_failed(cfg)
        steps = [args.step]
        if args.step == "all":  # a streamed run computes its hidden states in train: nothing to extract or verify
            steps = [s for s in STEPS if cfg.train.hidden_states == "disk" or s not in ("extract", "verify")]
        for step in steps:
            run(cfg, step, force=args.force, shard=shard)
    except (ConfigError, StepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
