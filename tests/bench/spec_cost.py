"""What one speculative step costs next to one plain decode step, and the speed-up that follows from it.

    python tests/bench/spec_cost.py --draft DRAFT_DIR [--eval EVAL_JSON] [--batches 1,16,80] [--context 320]
                                    [--k 3] [--al AL] [--overhead-ms MS] [--dtype float32] [--out RESULT.json]

DRAFT_DIR is a draft as speculators writes it (config.json + model.safetensors; a slim one restored with
`python -m pipeline.draft_transfer restore`). With the transformers engines on this machine's device (CPU here, the
GPU on the device machine), at context length C and batch B, it times
  t_T(B, 1)     the target's forward over 1 new token per sequence (a plain decode step),
  t_T(B, k+1)   the target's forward over k+1 new tokens per sequence (the verification of k drafts),
  t_D(B)        one draft step for B sequences (B positions through the draft's layers and its lm_head),
each the median of several runs, the KV cache cropped back to C after every run. The model, for greedy chain
speculative decoding with acceptance length AL (tokens per verification step):
  speed-up(B) = AL * (t_T(B, 1) + o) / (t_T(B, k+1) + k * t_D(B) + o)
where o (--overhead-ms, default 0) is what an engine pays per step beside the forwards (scheduling, sampling,
Python): both runs pay it once per step, so it favours speculation, which takes fewer steps. Measure it as the
engine's plain seconds per decode step at that batch minus t_T(B, 1). Left out: what only the speculative run pays
beyond the forwards (the proposer's bookkeeping).
With --eval (pipeline.evaluate's eval.json) it prints the measured vLLM tokens/s beside the prediction at that run's
batch (all prompts are submitted at once, so vLLM decodes them together: B = the prompt count at the start).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.env import setup_env  # noqa: E402

setup_env()
import torch  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure(target, draft, batch: int, context: int, k: int, repeats: int) -> dict:
    from transformers import DynamicCache

    from pipeline.engines.hf_spec_eval import _crop

    dev = next(target.parameters()).device
    gen = torch.Generator().manual_seed(batch)
    vocab = target.config.vocab_size
    ids = torch.randint(100, vocab, (batch, context), generator=gen).to(dev)
    cache = DynamicCache()
    target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def target_step(q: int):
        new = torch.randint(100, vocab, (batch, q), generator=gen).to(dev)

        def run():
            target(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=q).logits.argmax(-1)
            _crop(cache, context)
        return run

    t1 = median_time(target_step(1), repeats)
    tk = median_time(target_step(k + 1), repeats)

    # the draft: a short committed context in its cache, then one step of B positions (the matmuls of B sequences)
    draft.reset()
    hidden = draft.hidden
    feats = torch.randn(context, hidden, generator=gen).to(dev, draft.dtype)
    draft.forward(ids[0, :context], feats, torch.arange(context, device=dev))
    committed = draft.cached
    toks = ids[:, -1]
    step_feats = torch.randn(batch, hidden, generator=gen).to(dev, draft.dtype)
    pos = torch.arange(committed, committed + batch, device=dev)

    def draft_step():
        post, _ = draft.forward(toks, step_feats, pos)
        draft.argmax(post)
        draft.crop(committed)

    td = median_time(draft_step, repeats)
    return {"batch": batch, "context": context, "k": k, "target_decode_s": t1, "target_verify_s": tk,
            "draft_step_s": td, "verify_over_decode": tk / t1, "draft_over_decode": td / t1}


def predicted_speedup(row: dict, al: float, overhead_s: float = 0.0) -> float:
    return al * (row["target_decode_s"] + overhead_s) / (row["target_verify_s"] + row["k"] * row["draft_step_s"]
                                                          + overhead_s)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--target", type=Path, default=Path("data/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--eval", type=Path, help="pipeline.evaluate's eval.json: measured tokens/s and AL")
    ap.add_argument("--batches", default="1,16,80")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--al", type=float, help="acceptance length for the prediction (default: the eval's)")
    ap.add_argument("--overhead-ms", type=float, default=0.0, help="the engine's per-step cost beside the forwards")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from pipeline.engines.hf_engine import device, load_target
    from pipeline.engines.hf_spec_eval import Eagle3Draft

    dev = device()
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, args.dtype, dev=dev)
    draft = Eagle3Draft(args.draft, target, dtype, dev)
    measured, al = None, args.al
    if args.eval:
        ev = json.loads(args.eval.read_text())
        name, d = next((n, d) for n, d in ev["drafters"].items() if n != "untrained")
        al = al or d["acceptance_length"]
        measured = {"drafter": name, "prompts": ev.get("prompts") or ev.get("num_prompts"),
                    "baseline_tokens_per_s": ev["baseline_tokens_per_s"], "spec_tokens_per_s": d["tokens_per_s"],
                    "speedup": d["speedup"], "acceptance_length": d["acceptance_length"]}
    al = al or 2.0
    rows = [measure(target, draft, int(b), args.context, args.k, args.repeats) for b in args.batches.split(",")]
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; dtype {args.dtype}; context {args.context}; k = {args.k}; AL = {al:.3f}; "
          f"overhead {args.overhead_ms} ms/step")
    print("| batch | target decode ms | target verify (k+1) ms | draft step ms | verify/decode | draft/decode | "
          "predicted speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["predicted_speedup"] = predicted_speedup(r, al, args.overhead_ms / 1e3)
        print(f"| {r['batch']} | {r['target_decode_s'] * 1e3:.1f} | {r['target_verify_s'] * 1e3:.1f} | "
              f"{r['draft_step_s'] * 1e3:.1f} | {r['verify_over_decode']:.2f} | {r['draft_over_decode']:.2f} | "
              f"{r['predicted_speedup']:.2f} |")
    if measured:
        print(f"measured by the evaluator ({measured['drafter']}): baseline {measured['baseline_tokens_per_s']} tokens/s, "
              f"speculative {measured['spec_tokens_per_s']} tokens/s, speed-up {measured['speedup']}")
    if args.out:
        args.out.write_text(json.dumps({"device": where, "dtype": args.dtype, "acceptance_length": al,
                                        "overhead_ms": args.overhead_ms,
                                        "rows": rows, "measured": measured}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
