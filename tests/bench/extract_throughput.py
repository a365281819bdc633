"""Benchmark (a script, not a test): hidden-state extraction throughput against its two baselines.

    .venv/bin/python tests/bench/extract_throughput.py --config configs/smollm2-cpu.toml \
        [--samples 64] [--concurrency 4] [--modes extract,prefill,hf] [--out .cache/bench/extract.json]

Needs a run whose `prepare` step is complete (the prompts are its prepared samples, train then eval).
  extract  the pipeline's extraction server (extract_hidden_states + hidden-states connector), files
           written, waited for and deleted -- what `make extract` does per sample
  prefill  a vLLM server with the same model, dtype, max_model_len, batching and eager mode but no
           speculative method and no connector: the same prompts with max_tokens=1 (plain prefill);
           extract/prefill is the cost of capturing and writing the states
  hf       a naive transformers loop: one forward pass per sample with hooks (pipeline/engines/hf_reference),
           the states moved to CPU and saved with safetensors
Each mode reports tokens/s over the timed part only (server start excluded, reported separately).
One server at a time; the numbers go to --out as JSON and to stdout. On a shared machine timings are upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.env import setup_env  # noqa: E402

setup_env()


def samples(cfg, n: int) -> list[list[int]]:
    from pipeline.extract import load_samples

    got = [ids for _, _, ids in load_samples(cfg)]
    return got[:n] if n > 0 else got


def _timed_requests(fn, prompts, concurrency: int) -> float:
    t = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(fn, prompts))
    return time.time() - t


def bench_server(cfg, prompts, concurrency: int, extract: bool, work: Path) -> dict:
    import httpx

    from pipeline.engines.vllm_offline import cpu_only
    from pipeline.engines.vllm_server import VllmServer, extraction_server_args, request_hidden_states, worker_in_engine_core
    from pipeline.extract import resolve_layer_ids

    layer_ids, _, _ = resolve_layer_ids(cfg)
    staging = work / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    layout, layout_env = worker_in_engine_core(cfg.engine.llm_kwargs())  # the server extract starts
    args = extraction_server_args(
        cfg.model_path, layer_ids, staging, cfg.model.max_model_len, dtype=cfg.model.dtype, on_cpu=cpu_only(),
        extra=(["--trust-remote-code"] if cfg.model.trust_remote_code else []) + layout,
        max_num_batched_tokens=cfg.model.max_model_len * concurrency,
    )
    if not extract:  # same engine settings without the speculative method and the connector
        for flag in ("--speculative-config", "--kv-transfer-config"):
            i = args.index(flag)
            del args[i:i + 2]
    t0 = time.time()
    with VllmServer(args, log_path=work / f"server-{'extract' if extract else 'prefill'}.log", env={**os.environ, **layout_env},
                    startup_timeout=cfg.extract.startup_timeout_s) as server, httpx.Client(timeout=600) as client:
        start_s = time.time() - t0

        def one(ids):
            if extract:
                Path(request_hidden_states(client, server.base_url, str(cfg.model_path), ids)).unlink()
            else:
                r = client.post(f"{server.base_url}/v1/completions",
                                json={"model": str(cfg.model_path), "prompt": ids, "max_tokens": 1, "temperature": 0.0})
                r.raise_for_status()

        one(prompts[0])  # warm-up (first-request compilation/allocation)
        seconds = _timed_requests(one, prompts, concurrency)
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "server_start_s": round(start_s, 1), "concurrency": concurrency}


def bench_hf(cfg, prompts, work: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    from pipeline.engines.hf_reference import hidden_states, load_model
    from pipeline.extract import resolve_layer_ids

    layer_ids, _, _ = resolve_layer_ids(cfg)
    t0 = time.time()
    model = load_model(cfg.model_path, cfg.model.dtype, cfg.model.trust_remote_code)
    load_s = time.time() - t0
    out = work / "hf"
    out.mkdir(parents=True, exist_ok=True)
    hidden_states(model, prompts[0], layer_ids)  # warm-up
    t = time.time()
    with torch.inference_mode():
        for k, ids in enumerate(prompts):
            hs = hidden_states(model, ids, layer_ids).to(getattr(torch, cfg.model.dtype)).cpu().contiguous()
            path = out / f"hs_{k}.safetensors"
            save_file({"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(path))
            path.unlink()
    seconds = time.time() - t
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "model_load_s": round(load_s, 1), "batch_size": 1}


def main() -> int:
    from pipeline.config import load_config
    from pipeline.manifest import require_manifest

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-cpu.toml")
    ap.add_argument("--samples", type=int, default=64, help="prepared samples to send (0 = all)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--modes", default="extract,prefill,hf")
    ap.add_argument("--out", default=".cache/bench/extract_throughput.json")
    a = ap.parse_args()
    cfg = load_config(a.config)
    require_manifest(cfg, "prepare")
    prompts = samples(cfg, a.samples)
    work = REPO / ".cache" / "bench" / "work"
    work.mkdir(parents=True, exist_ok=True)
    result = {"config": a.config, "samples": len(prompts), "tokens": sum(map(len, prompts)), "modes": {}}
    for mode in a.modes.split(","):
        if mode == "extract":
            r = bench_server(cfg, prompts, a.concurrency, True, work)
        elif mode == "prefill":
            r = bench_server(cfg, prompts, a.concurrency, False, work)
        elif mode == "hf":
            r = bench_hf(cfg, prompts, work)
        else:
            sys.exit(f"unknown mode {mode!r}")
        result["modes"][mode] = r
        print(f"{mode:8s} {r['tokens_per_s']:>10,.1f} tokens/s  ({r['tokens']} tokens in {r['seconds']} s)", flush=True)
    m = result["modes"]
    if "extract" in m and "prefill" in m:
        result["extract_vs_prefill"] = round(m["extract"]["tokens_per_s"] / m["prefill"]["tokens_per_s"], 3)
    if "extract" in m and "hf" in m:
        result["extract_vs_hf"] = round(m["extract"]["tokens_per_s"] / m["hf"]["tokens_per_s"], 3)
    out = REPO / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
