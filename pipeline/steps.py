"""The step table: what each step runs, which config sections and upstream steps it depends on."""
from __future__ import annotations

import importlib
import sys

from .config import Config
from .manifest import StepError, run_step, sha256_file, step_fingerprint

# name: (module with run(cfg, out), config sections, upstream steps, keep partial outputs for resume)
STEPS = {
    "model": ("model", ("model",), (), False),
    "prepare": ("prepare", ("run", "data"), ("model",), True),  # resumes regeneration
    "extract": ("extract", ("extract",), ("model", "prepare"), True),
    "verify": ("verify", ("verify",), ("model", "extract"), False),
    "vocab": ("vocab", ("vocab",), ("model", "prepare"), False),
    "train": ("train", ("train", "vocab"), ("verify", "vocab"), True),
    "eval": ("evaluate", ("eval",), ("train",), False),
    "report": ("report", (), ("model", "prepare", "extract", "verify", "vocab", "train", "eval"), False),
}


# Steps whose work can be split over processes/nodes with --shard i/n.
SHARDABLE = ("extract",)


DRAFT_FILES = ("config.json", "model.safetensors")


def upstream_of(cfg: Config, step: str) -> tuple[tuple[str, ...], dict]:
    """(upstream steps, extra inputs): eval of a drafter made elsewhere (eval.draft) needs only the model step,
    and the drafter's files stand in for the train step's outputs in its fingerprint; prepare of a mix
    (data.sources) or of a local file (data.path) has its files' contents in its fingerprint; so has train of the
    drafter it starts from (train.init_from)."""
    upstream, extra = _upstream_of(cfg, step)
    if step == "train" and cfg.train.init_from:
        from .train import init_hashes

        extra = {**extra, "init_from": init_hashes(cfg)}
    return upstream, extra


def _upstream_of(cfg: Config, step: str) -> tuple[tuple[str, ...], dict]:
    upstream = STEPS[step][2]
    if cfg.train.hidden_states == "stream" and step in ("train", "report"):
        # the target computes the hidden states inside train: no extract or verify upstream; what it computes
        # with (layer ids, dtype) stands in for the extraction's manifest in train's fingerprint
        if step == "report":
            return tuple(s for s in upstream if s not in ("extract", "verify")), {}
        from .train import stream_spec

        spec = stream_spec(cfg)
        return ("model", "prepare", "vocab"), {"stream": {k: spec[k] for k in ("layer_ids", "dtype")}}
    if step == "prepare" and cfg.data.sources:  # the files' contents, not only their names (the packaged one is pinned)
        from .config import PACKAGED_SOURCES

        return upstream, {"sources": [s if s in PACKAGED_SOURCES else sha256_file(cfg.path(s)) for s in cfg.data.sources]}
    if step == "prepare" and cfg.data.path:  # a local file instead of the packaged one: its contents too, so an edited
        from .datasets import local_file    # file is prepared again

        try:  # prepare's own refusal of a missing file, here before run_step would empty a finished prepare
            p = local_file(cfg.data.path)
        except StepError as e:
            raise StepError(f"{e}. Restore the file or fix data.path in {cfg.source_path}; nothing in "
                            f"{cfg.step_dir('prepare')} was changed") from None
        return upstream, {"path": sha256_file(p)}
    if step == "eval" and cfg.eval.draft:
        from .evaluate import given_draft

        d = given_draft(cfg)
        extra = {"draft": {f: sha256_file(d / f) for f in DRAFT_FILES}}
        if cfg.eval.prompts == "heldout":  # the prompts come from [run] and [data] (and the sources' contents)
            extra["heldout_from"] = [cfg.section_hash("run", "data"), upstream_of(cfg, "prepare")[1]]
        return ("model",), extra
    return upstream, {}


def warn_slow_dtype(cfg: Config, step: str) -> None:
    """A warning (not a refusal: GPU figures are reproduced in bf16) when a step computes in bf16 on a CPU without it."""
    section = {"prepare": "model", "extract": "model", "verify": "model", "eval": "eval"}.get(step)
    if section:
        from .env import slow_cpu_dtype

        msg = slow_cpu_dtype(getattr(cfg, section).dtype, f"{section}.dtype")
        if msg:
            print(f"[{step}] warning: {msg}", file=sys.stderr, flush=True)


def run(cfg: Config, step: str, force: bool = False, shard: tuple[int, int] | None = None) -> dict:
    if step not in STEPS:
        raise NotImplementedError(f"step '{step}' is not implemented yet")
    if shard is not None and step not in SHARDABLE:
        raise StepError(f"--shard applies to {', '.join(SHARDABLE)} only, not '{step}'")
    module, sections, _, keep = STEPS[step]
    mod = importlib.import_module(f"pipeline.{module}")
    if hasattr(mod, "preflight"):  # refusals that must come before run_step empties the step's folder (--force)
        mod.preflight(cfg)
    warn_slow_dtype(cfg, step)
    upstream, extra = upstream_of(cfg, step)
    return run_step(cfg, step, mod.run, sections=sections, upstream=upstream, force=force, keep_partial=keep, shard=shard,
                    extra_inputs=extra)


def fingerprint(cfg: Config, step: str) -> str:
    """The fingerprint `run` gives the step's folder for this config and the upstream outputs now on disk."""
    _, sections, _, _ = STEPS[step]
    upstream, extra = upstream_of(cfg, step)
    return step_fingerprint(cfg, step, sections, upstream, extra)[1]
