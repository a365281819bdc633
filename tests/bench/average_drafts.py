"""Average the weights of drafters of the same shape (a "model soup"), for serving with pipeline.evaluate.

    PYTHONPATH=$PWD .venv/bin/python tests/bench/average_drafts.py OUT DRAFT_A DRAFT_B [...]

Each DRAFT is any form `pipeline.draft_transfer` reads (a full checkpoint, a slim folder, a shipped drafter); OUT
is written in the shipped form (`draft_transfer ship`: no embedding). Float tensors are averaged uniformly (in
float32, saved in their own dtype); every other tensor (the vocabulary maps d2t/t2d) must be equal in all of
them, or the drafters are not averageable and this stops. config.json comes from the first. Session 35 (NOTES
"Session 35"): the start and the end of a continuation averaged served MT-bench 2.592 against 2.579 and 2.571,
with the held-out sets unchanged.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.draft_transfer import _served_weights


def average(out: Path, drafts: list[Path]) -> int:
    states = [_served_weights(d) for d in drafts]
    for d, s in zip(drafts[1:], states[1:]):
        if s.keys() != states[0].keys():
            raise SystemExit(f"{d}: other tensors than {drafts[0]}; only drafters of one shape can be averaged")
    avg = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            avg[k] = (sum(s[k].float() for s in states) / len(states)).to(v.dtype)
        elif all(torch.equal(s[k], v) for s in states):
            avg[k] = v
        else:
            raise SystemExit(f"{k} differs between the drafters (another draft vocabulary?): not averageable")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(drafts[0] / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in avg.items()}, str(out / "model.safetensors"))
    return len(avg)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    out, *drafts = map(Path, sys.argv[1:])
    n = average(out, drafts)
    print(f"[average] {n} tensors, the mean of {len(drafts)} drafters -> {out}")
