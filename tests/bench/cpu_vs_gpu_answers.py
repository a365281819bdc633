"""How close the target's greedy answers made here on the CPU (vLLM) are to those the H200 made (transformers, bf16).

    python3 tests/bench/cpu_vs_gpu_answers.py [--n 64] [--dtypes bfloat16,float32]

Session 29 regenerated answers for the training mix on the CPU (no device lent), while every earlier answer in the
seed (data/seeds/smollm2-135m-instruct-mix-answers.jsonl.xz) came from the H200. This takes the first N requests of
data/prompts/self-prompts-2.jsonl.gz (their H200 answers are in the seed), answers them again with prepare's own
engine and settings (vllm_offline, greedy, data.max_new_tokens 256, model.max_model_len 1040) in each dtype, and
prints per dtype: answers identical to the H200's, and the tokens the two share from the start (a greedy decode
that differs once goes its own way after). float32 is the dtype the evaluator serves the target in (eval.dtype).
Not a unit test: numbers for NOTES.
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.chat import prompt_ids_batch  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.engines.vllm_offline import close, generate, target_llm  # noqa: E402
from pipeline.env import setup_env  # noqa: E402
from pipeline.prepare import load_tokenizer  # noqa: E402

SOURCE = ROOT / "data/prompts/self-prompts-2.jsonl.gz"
SEED = ROOT / "data/seeds/smollm2-135m-instruct-mix-answers.jsonl.xz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    setup_env()
    cfg = load_config(ROOT / "configs/smollm2-quality.toml")
    tok = load_tokenizer(cfg)
    seed = {}
    with lzma.open(SEED, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r["id"].startswith("self-prompts-2/"):
                seed[r["id"]] = r["answers"][0]
    recs = []
    with gzip.open(SOURCE, "rt") as f:
        for line in f:
            r = json.loads(line)
            if f"self-prompts-2/{r['id']}" in seed:
                recs.append(r)
            if len(recs) == args.n:
                break
    gpu = [seed[f"self-prompts-2/{r['id']}"] for r in recs]
    prompts = prompt_ids_batch(tok, [[{"role": "user", "content": r["conversations"][0]["value"]}] for r in recs])
    rows = {}
    for dtype in args.dtypes.split(","):
        t0 = time.time()
        llm = target_llm(cfg, dtype=dtype)
        try:
            cpu = [g.text for g in generate(llm, prompts, max_new_tokens=cfg.data.max_new_tokens,
                                            temperature=0.0, seed=cfg.run.seed)]
        finally:
            close(llm)
        shared, lengths = [], []
        for a, b in zip(cpu, gpu):
            ta, tb = tok(a, add_special_tokens=False).input_ids, tok(b, add_special_tokens=False).input_ids
            k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            shared.append(k)
            lengths.append(len(tb))
        rows[dtype] = {"answers": len(cpu), "identical": sum(a.strip() == b.strip() for a, b in zip(cpu, gpu)),
                       "mean_shared_prefix_tokens": round(sum(shared) / len(shared), 1),
                       "mean_h200_answer_tokens": round(sum(lengths) / len(lengths), 1),
                       "shared_prefix_fraction": round(sum(shared) / max(1, sum(lengths)), 3),
                       "seconds": round(time.time() - t0, 1)}
        print(dtype, rows[dtype], flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
