"""Acceptance length per MT-bench category, for one or more drafters (where is a drafter weakest?).

    .venv/bin/python tests/bench/mtbench_by_category.py [--config C] [--max-tokens 128] NAME=DRAFTER [NAME=DRAFTER ...]

vLLM's spec-decode counters are one sum over a run, so the served evaluator cannot split its AL by prompt. This
decodes the same 80 MT-bench first turns with the transformers evaluator (`pipeline.engines.hf_spec_eval.decode`:
greedy chain speculative decoding, K from the config, the engine `pipeline.evaluate --set eval.engine=hf` runs,
whose counters agree with vLLM's under test) and sums its counters per category. Each drafter's overall AL is
printed beside its categories, to compare with the vLLM figure (float32 on CPU, as the evaluator).
Prints a table (drafters x categories) and writes it as JSON with --out, each prompt's counters included.

With two or more drafters it also prints each one's difference from the first, paired by prompt, with a 95 %
bootstrap interval over the 80 prompts (resampled together for both drafters; AL is a ratio of sums, so whole
prompts are resampled, not tokens). The interval is what MT-bench's choice of prompts alone allows; it says
nothing of the run-to-run spread of training, which adds to it.

--target-confidence adds the target's own confidence per category, without any drafter: along its greedy output
of each prompt (one forward over prompt + output), the mean probability of its top token and the share of
positions where that probability is under 0.5. A greedy draft must guess the target's argmax; where the target
itself is unsure, the argmax is harder to guess from the hidden states, whatever the data.
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pipeline.env import setup_env  # noqa: E402

setup_env()
import torch  # noqa: E402

from pipeline.chat import prompt_ids  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.datasets import load_mtbench  # noqa: E402
from pipeline.engines.hf_engine import load_target, stop_token_ids  # noqa: E402
from pipeline.engines.hf_spec_eval import Eagle3Draft, decode  # noqa: E402
from pipeline.evaluate import first_turns, spec_metrics  # noqa: E402

COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")
BOOTSTRAP = 10000


def total(stats: list[dict]) -> dict:
    """decode()'s counters of several prompts, summed."""
    return {**{f: sum(s[f] for s in stats) for f in COUNTERS},
            "accepted_per_pos": [sum(a) for a in zip(*(s["accepted_per_pos"] for s in stats))]}


def paired_difference(a: list[dict], b: list[dict], seed: int = 0) -> dict:
    """AL(b) - AL(a) over the same prompts (per-prompt counters, in order), with the 2.5 and 97.5 percentiles of
    the difference when the prompts are resampled with replacement (the same draw for both) BOOTSTRAP times.
    AL here is spec_metrics' 1 + accepted / drafts, unrounded: rounding each resample's AL would coarsen the
    percentiles."""
    import random

    def al(stats, idx):
        drafts = sum(stats[i]["drafts"] for i in idx)
        return 1 + sum(stats[i]["accepted_tokens"] for i in idx) / drafts if drafts else 1.0

    everyone = range(len(a))
    rng = random.Random(seed)
    diffs = sorted(al(b, idx) - al(a, idx) for idx in ([rng.randrange(len(a)) for _ in everyone] for _ in range(BOOTSTRAP)))
    return {"diff": round(al(b, everyone) - al(a, everyone), 4), "ci95": [round(diffs[int(0.025 * BOOTSTRAP)], 4),
            round(diffs[int(0.975 * BOOTSTRAP) - 1], 4)], "prompts_higher": sum(
            al(b, [i]) > al(a, [i]) for i in everyone), "prompts_lower": sum(al(b, [i]) < al(a, [i]) for i in everyone)}


def target_confidence(target, prompts: list[tuple[str, list[int]]], max_tokens: int, max_len: int,
                      stop: set[int]) -> dict:
    """Per category (and "all"): the target's top-1 probability along its own greedy output, averaged over the
    output positions, and the share of those positions where it is under 0.5."""
    per = defaultdict(list)
    for cat, ids in prompts:
        out = decode(target, ids, max_tokens=max_tokens, max_model_len=max_len, stop=stop)
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1:len(ids) + len(out) - 1]
        top1 = logits.float().softmax(-1).max(-1).values.tolist()
        per[cat] += top1
        per["all"] += top1
    return {c: {"positions": len(v), "mean_top1": round(sum(v) / len(v), 4),
                "share_under_half": round(sum(p < 0.5 for p in v) / len(v), 4)} for c, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-shipped.toml")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the config's eval.max_tokens")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--target-confidence", action="store_true", help="also the target's confidence per category")
    ap.add_argument("drafters", nargs="*", help="NAME=PATH of a drafter folder (config.json + model.safetensors)")
    args = ap.parse_args()
    if not args.drafters and not args.target_confidence:
        ap.error("name at least one drafter, or --target-confidence")
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # as the evaluator on CPU: one sequence's small ops, 1 thread is fastest
    cfg = load_config(args.config, {"eval.max_tokens": args.max_tokens} if args.max_tokens else {})
    k, max_tokens, max_len = cfg.eval.num_speculative_tokens, cfg.eval.max_tokens, cfg.model.max_model_len
    dev = torch.device("cpu")
    target = load_target(cfg.model_path, cfg.eval.dtype, cfg.model.trust_remote_code, dev)
    tok = AutoTokenizer.from_pretrained(cfg.model_path, trust_remote_code=cfg.model.trust_remote_code)
    stop = stop_token_ids(cfg.model_path, tok, target)
    # the evaluator's prompts (evaluate.first_turns, and eval_prompts' length rule), each with its category
    prompts = [(q["category"], prompt_ids(tok, m)) for q, m in zip(load_mtbench(cfg.run.stack), first_turns(cfg))]
    prompts = [(cat, ids) for cat, ids in prompts if len(ids) + max_tokens <= max_len]
    table = {}
    for spec in args.drafters:
        name, _, path = spec.partition("=")
        draft = Eagle3Draft(path, target, getattr(torch, cfg.eval.dtype), dev)
        prompt_stats = []
        t0 = time.time()
        for cat, ids in prompts:
            prompt_stats.append({**dict.fromkeys(COUNTERS, 0), "accepted_per_pos": [0] * k})
            decode(target, ids, max_tokens=max_tokens, max_model_len=max_len, stop=stop, draft=draft, k=k,
                   stats=prompt_stats[-1])
        per = {cat: total([s for (c, _), s in zip(prompts, prompt_stats) if c == cat])
               for cat in dict.fromkeys(c for c, _ in prompts)}
        per["all"] = total(prompt_stats)
        table[name] = {"path": path, "seconds": round(time.time() - t0, 1),
                       "al": {c: round(spec_metrics(v, k)["acceptance_length"], 3) for c, v in per.items()},
                       "counters": per, "per_prompt": prompt_stats}
        print(f"[by-category] {name}: AL {table[name]['al']['all']:.3f} over {len(prompts)} prompts "
              f"({table[name]['seconds']} s)", flush=True)
    cats = list(dict.fromkeys(c for c, _ in prompts)) + ["all"]
    print("| drafter | " + " | ".join(cats) + " |")
    print("|---" * (len(cats) + 1) + "|")
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{r['al'][c]:.3f}" for c in cats) + " |")
    names = list(table)
    for name in names[1:]:
        table[name]["vs_first"] = paired_difference(table[names[0]]["per_prompt"], table[name]["per_prompt"])
        d = table[name]["vs_first"]
        print(f"[by-category] {name} - {names[0]}: {d['diff']:+.4f} AL, 95 % interval over prompts "
              f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]; higher on {d['prompts_higher']}, lower on {d['prompts_lower']}")
    confidence = target_confidence(target, prompts, max_tokens, max_len, stop) if args.target_confidence else None
    if confidence:
        for key, what in (("mean_top1", "target: mean top-1 probability"), ("share_under_half", "target: top-1 < 0.5")):
            print(f"| {what} | " + " | ".join(f"{confidence[c][key]:.3f}" for c in cats) + " |")
    if args.out:
        args.out.write_text(json.dumps({"config": args.config, "max_tokens": max_tokens, "k": k,
                                        "prompts": len(prompts), "drafters": table,
                                        **({"target_confidence": confidence} if confidence else {})}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
