"""Decode throughput of prepare's transformers engine (`hf_engine.generate_batch`) on a GPU, against an older copy.

    python3 tests/bench/regen_throughput.py [--baseline OLD_hf_engine.py] [--shapes 2048x512,1024x256]
                                            [--new-tokens 64] [--variants eager,nosync,graph] [--out FILE.json]

A SmolLM2-135M-shaped model with random weights (bf16; the cost of a decode step does not depend on the weights,
and with random weights no row stops early, so every batch decodes exactly --new-tokens steps), batches of B
prompts of widths 0.8 W .. W (left-padded, as prepare's length-sorted batches are). Prints and writes generated
tokens/s per shape for the current engine and, with --baseline, for the generate_batch of that file (e.g.
`git show 1faced6:pipeline/engines/hf_engine.py > .cache/bench/hf_engine_1faced6.py`: the engine before the
StaticCache and grouped-query decode of session 13). --variants times the current engine's options: `eager`
(check_every=1, cuda_graph=False: the engine of sessions 13-39), `nosync` (check_every=16: no wait for the GPU at
every step), `graph` (nosync plus the decode step as a CUDA graph: the defaults since session 40); each variant's
token ids on the first 64 prompts are compared with the first variant's (`same_as_first`). Not a unit test:
numbers for NOTES.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipeline.engines import hf_engine  # noqa: E402


def smollm2_shaped():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).to(hf_engine.device()).eval()


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("pipeline.engines._baseline_hf_engine", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "pipeline.engines"
    spec.loader.exec_module(mod)
    return mod.generate_batch


def time_one(fn, model, prompts, new_tokens: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.time()
    outs = fn(model, prompts, max_new_tokens=new_tokens, temperature=0.0, stop=set(), pad_id=0)
    sync()
    s = time.time() - t0
    assert all(len(ids) == new_tokens for ids, _ in outs), "a row stopped early"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="an older hf_engine.py whose generate_batch is timed beside the current one")
    ap.add_argument("--shapes", default="2048x512,1024x256", help="BATCHxWIDTH,...")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default="graph", help="eager,nosync,graph (options of generate_batch)")
    ap.add_argument("--out")
    a = ap.parse_args()
    model = smollm2_shaped()
    options = {"eager": {"check_every": 1, "cuda_graph": False}, "nosync": {"check_every": 16, "cuda_graph": False},
               "graph": {"check_every": 16, "cuda_graph": True}}
    impls = {v: functools.partial(hf_engine.generate_batch, **options[v]) for v in a.variants.split(",")}
    if a.baseline:
        impls["baseline"] = load_baseline(a.baseline)
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        b, w = (int(x) for x in shape.split("x"))
        lens = torch.randint(int(0.8 * w), w + 1, (b,), generator=g).tolist()
        prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lens]
        ref = None
        for name, fn in impls.items():
            try:
                time_one(fn, model, prompts[:8], 4)  # warm-up (kernels, allocator)
                check = fn(model, prompts[:64], max_new_tokens=16, temperature=0.0, stop=set(), pad_id=0)
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                s = time_one(fn, model, prompts, a.new_tokens)
            except Exception as e:  # noqa: BLE001 (a variant that fails is a result too)
                row = {"impl": name, "batch": b, "width": w, "error": f"{type(e).__name__}: {e}"[:400]}
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            ref = check if ref is None else ref
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            row = {"impl": name, "batch": b, "width": w, "new_tokens": a.new_tokens, "seconds": round(s, 2),
                   "tokens_per_s": round(b * a.new_tokens / s), "ms_per_step": round(1000 * s / a.new_tokens, 1),
                   "peak_gib": round(peak, 1), "same_as_first": check == ref}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    if a.out:
        Path(a.out).write_text(json.dumps({"device": str(hf_engine.device()), "torch": torch.__version__,
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
