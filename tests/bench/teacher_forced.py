"""Diagnostic (a script, not a test): a draft's teacher-forced step-0 accuracy on an eval run's own outputs.

    .venv/bin/python tests/bench/teacher_forced.py EVAL_DIR DRAFT_CKPT [--dtype float32|bfloat16]

EVAL_DIR is an `eval` output folder (baseline.request.json + baseline.result.json: the prompts and the
target's greedy outputs). For every output token after the first, the draft predicts it from the target's
aux hidden states and the previous token, as vLLM's first speculative position does, but on the target's
own text rather than after its own earlier proposals. Compared with the served position-0 acceptance of
the same run, it separates a serving defect (teacher-forced high, served low by much) from what the draft
simply does not know; the accuracy is also broken down by position in the output (32-token buckets) and by
the target's own confidence in the token (its top-1 probability): where the target itself hesitates between
continuations, a drafter that sees only its states up to the token before has little to go on.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()

    from pipeline.env import setup_env

    setup_env()
    import torch

    from pipeline.engines.hf_engine import capture_layers, load_target
    from pipeline.engines.hf_spec_eval import Eagle3Draft

    req = json.loads((a.eval_dir / "baseline.request.json").read_text())
    res = json.loads((a.eval_dir / "baseline.result.json").read_text())
    target = load_target(req["model"], a.dtype, dev=torch.device("cpu"))
    draft = Eagle3Draft(a.draft, target, getattr(torch, a.dtype), torch.device("cpu"))
    buckets: dict[int, list[int]] = {}  # 32-token bucket of the output position -> [correct, total]
    conf_edges = (0.5, 0.8, 0.95, 1.01)
    by_conf = {e: [0, 0] for e in conf_edges}  # upper edge of the target's top-1 probability -> [correct, total]
    for prompt, output in zip(req["prompts"], res["outputs"]):
        seq = prompt + output
        with torch.no_grad(), capture_layers(target, draft.aux_ids) as got:
            logits = target(input_ids=torch.tensor([seq])).logits[0].float()
        greedy = logits.argmax(-1)  # [i] = token at i+1
        conf = logits.softmax(-1).max(-1).values  # the target's top-1 probability of that token
        aux = torch.cat([got[i][0] for i in draft.aux_ids], -1)
        draft.reset()
        with torch.no_grad():  # pair i: token i+1 with the target's states at i -> predicts token i+2
            post, _ = draft.forward(torch.tensor(seq[1:]), draft.combine(aux[:-1]), torch.arange(len(seq) - 1))
            pred = draft.argmax(post)
        for i in range(len(prompt) - 1, len(seq) - 2):  # predictions of output tokens 2.. (token 1 is the target's)
            c = buckets.setdefault(min((i + 2 - len(prompt)) // 32, 3), [0, 0])
            hit = int(pred[i] == greedy[i + 1])
            c[0] += hit
            c[1] += 1
            k = next(e for e in conf_edges if conf[i + 1] < e)
            by_conf[k][0] += hit
            by_conf[k][1] += 1
    right, total = (sum(v[i] for v in buckets.values()) for i in (0, 1))
    by_pos = {f"{b * 32}-{b * 32 + 31}" if b < 3 else "96+": round(v[0] / v[1], 3) for b, v in sorted(buckets.items())}
    lows = (0.0,) + conf_edges[:-1]
    conf_rows = {f"{lo:.2f}-{min(hi, 1.0):.2f}": {"share": round(v[1] / total, 3), "accuracy": round(v[0] / max(v[1], 1), 3)}
                 for lo, (hi, v) in zip(lows, by_conf.items())}
    print(json.dumps({"dtype": a.dtype, "tokens": total, "step0_accuracy": round(right / total, 4),
                      "by_output_position": by_pos, "by_target_top1_probability": conf_rows}))


if __name__ == "__main__":
    main()
