"""Extraction on the vllm-0.16 stack: speculators 0.3.0's hidden-states generator on vLLM 0.16.

vLLM 0.16 has no `extract_hidden_states` method (it arrived in 0.17), so this stack drives the
generator that speculators 0.3.0 wrote for vLLM 0.11, ported to vLLM 0.16 by the patch series
patches/speculators/0.3.0/ (what each patch fixes: that folder's NOTES.md). The series also makes the
generator speak vLLM's layer-id convention (id k = residual stream entering decoder layer k, id N =
last layer's output before the final norm), so the pipeline's ids are passed through unchanged.

Runs inside the stack's own venv (`.venv-vllm-0.16/bin/python -m pipeline extract --config ...`).
Writes exactly what the native path writes: out/<split>/hs_<index>.safetensors =
{"hidden_states": [T, len(layer_ids), H] in the configured dtype, layers in ascending id order,
 "token_ids": int64 [T]}, each written under a temporary name in a staging folder inside `out` and
renamed into place (a file is complete or absent). Every result is checked (layer count, shape, token ids) before it is
written: a generator that returns the wrong layers or rows fails the step instead of writing them.

Environment overrides:
  EAGLE3_LEGACY_TP                    tensor_parallel_size (default: engine.tensor_parallel_size)
  EAGLE3_LEGACY_GPU_MEMORY_UTILIZATION  gpu_memory_utilization (default: engine.gpu_memory_utilization, else 0.8)
  EAGLE3_LEGACY_MAX_BATCHED_TOKENS    lower bound of the per-step token budget (generator default 8192;
                                      the budget is max(this, max_model_len)); tests lower it to make
                                      every call span several steps
  EAGLE3_ALLOW_PARTIAL_PATCHES=1      run even if the imported speculators is not fully patched (tests
                                      use it to show what each patch prevents); otherwise refused
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..config import REPO_ROOT, Config
from ..hidden_states import file_name
from ..manifest import StepError, require_patched_speculators, speculators_patch_state

SPECULATORS_VERSION = "0.3.0"
CALL_BUDGETS = 2  # tokens per generate() call = 2 x the per-step token budget (the series handles > budget)


def patch_state() -> dict:
    """Which speculators is imported and whether the 0.3.0 series is fully applied to it; refused unless it is
    (manifest.require_patched_speculators: patches an image left out by tag, e.g. 0002 `cpu-only` in the GPU images,
    are not required)."""
    state = speculators_patch_state()
    if state.get("version") != SPECULATORS_VERSION:
        raise StepError(
            f"the vllm-0.16 stack needs speculators=={SPECULATORS_VERSION}, this interpreter has "
            f"{state.get('version', 'none')} ({sys.executable}); run the extract step with .venv-vllm-0.16/bin/python "
            f"(build it with `docker/setup-venv.sh vllm-0.16 .venv-vllm-0.16`)"
        )
    state = require_patched_speculators(state=state)  # refused unless fully patched or EAGLE3_ALLOW_PARTIAL_PATCHES=1
    return {"speculators_path": state["site"], "series_sha256": state.get("series_sha256"),  # None: not checkable
            "not_applied": state.get("not_applied", [f"unknown ({state.get('error')})"])}


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else default


def start_generator(model_path: Path, layer_ids: list[int], max_model_len: int, trust_remote_code: bool,
                    tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, dtype: str = "auto"):
    """The patched VllmHiddenStatesGenerator (starts vLLM's engine; ~10-20 s for a small model on CPU)."""
    import speculators.data_generation.vllm_hidden_states_generator as vhg

    budget = _env_int("EAGLE3_LEGACY_MAX_BATCHED_TOKENS", None)
    if budget:
        vhg.MIN_MAX_BATCHED_TOKENS = budget
    return vhg.VllmHiddenStatesGenerator(
        str(model_path),
        layer_ids=list(layer_ids),
        max_model_len=max_model_len,
        gpu_memory_utilization=float(os.environ.get("EAGLE3_LEGACY_GPU_MEMORY_UTILIZATION") or gpu_memory_utilization or 0.8),
        tensor_parallel_size=_env_int("EAGLE3_LEGACY_TP", tensor_parallel_size),
        trust_remote_code=trust_remote_code,
        dtype=dtype,  # patch 0013
    )


def step_budget(gen) -> int:
    return int(gen.vllm_config.scheduler_config.max_num_batched_tokens)


def batches(todo: list, tokens_per_call: int) -> list[list]:
    """Consecutive groups of samples with at most tokens_per_call tokens (at least one sample each)."""
    out, cur, n = [], [], 0
    for item in todo:
        if cur and n + len(item[2]) > tokens_per_call:
            out.append(cur)
            cur, n = [], 0
        cur.append(item)
        n += len(item[2])
    if cur:
        out.append(cur)
    return out


def check_result(result: dict, ids: list[int], num_ids: int, hidden: int) -> str | None:
    """A reason this generator result is not [T, H] states for each of the num_ids layers of `ids`."""
    hs = result.get("hidden_states") or []
    shapes = [tuple(h.shape) for h in hs]
    want = (len(ids), hidden)
    if len(hs) != num_ids or any(s != want for s in shapes):
        return (f"the generator returned {len(hs)} layer tensor(s) of shape(s) {sorted(set(shapes))}; "
                f"expected {num_ids} x {list(want)}")
    if result["input_ids"].tolist() != ids:
        return "the generator's input_ids differ from the sample's token ids"
    return None


def extract_legacy(cfg: Config, todo: list[tuple[str, int, list[int]]], out: Path, layer_ids: list[int],
                   hidden: int, staging: Path | None = None) -> dict:
    """Extract hidden states for `todo` = [(split, index, token ids)] with the patched 0.3.0 generator.

    staging: folder for the temporary files (same file system as `out`); default a folder of this
    process inside `out`, removed afterwards (shards running at the same time do not collide)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    state = patch_state()
    longest = max(len(ids) for _, _, ids in todo)
    if longest >= cfg.model.max_model_len:
        raise StepError(f"a sample has {longest} tokens; the generator needs fewer than model.max_model_len "
                        f"({cfg.model.max_model_len}) (it truncates to max_model_len - 1)")
    dtype = getattr(torch, cfg.model.dtype)
    own_staging = staging is None
    staging = staging or out / f".staging-legacy-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    gen = start_generator(cfg.model_path, layer_ids, cfg.model.max_model_len, cfg.model.trust_remote_code,
                          cfg.engine.tensor_parallel_size, cfg.engine.gpu_memory_utilization, dtype=cfg.model.dtype)
    stats = {"server_start_s": round(time.time() - t0, 1), "extract_s": 0.0, "tokens_extracted": 0,
             "engine": f"speculators {SPECULATORS_VERSION} VllmHiddenStatesGenerator (patched)",
             "engine_dtype": str(gen.vllm_config.model_config.dtype).removeprefix("torch."),
             "patch_series_sha256": state["series_sha256"], "patches_not_applied": state["not_applied"]}
    try:
        budget = step_budget(gen)
        calls = batches(todo, CALL_BUDGETS * budget)
        stats.update(step_token_budget=budget, generate_calls=len(calls))
        t1 = time.time()
        with tqdm(total=sum(len(x[2]) for x in todo), unit="tok", desc="extract (speculators 0.3.0)") as bar:
            for call in calls:
                results = gen.generate([ids for _, _, ids in call])
                if len(results) != len(call):
                    raise StepError(f"the generator returned {len(results)} results for {len(call)} samples")
                for (split, i, ids), res in zip(call, results):
                    reason = check_result(res, ids, len(layer_ids), hidden)
                    if reason:
                        raise StepError(f"sample {split}/{i}: {reason} (layer ids {layer_ids})")
                    states = torch.stack(res["hidden_states"], dim=1).to(dtype).contiguous()
                    tmp = staging / f"{split}-{file_name(i)}"
                    save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(tmp))
                    os.replace(tmp, out / split / file_name(i))
                    stats["tokens_extracted"] += len(ids)
                    bar.update(len(ids))
        stats["extract_s"] = round(time.time() - t1, 1)
    finally:
        gen.executor.shutdown()
        if own_staging:
            shutil.rmtree(staging, ignore_errors=True)
    return stats
