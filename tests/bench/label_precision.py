"""Diagnostic (a script, not a test): how often the training labels' top token differs from the served target's.

    .venv/bin/python tests/bench/label_precision.py EVAL_DIR [EVAL_DIR ...] [--draft CKPT] [--out FILE]

speculators trains the draft against `verifier_lm_head(verifier_norm(h))`, where h is the target's last-layer
hidden state as extracted (bf16 on the GPU runs: `model.dtype = "bfloat16"`) and the head runs under bf16 autocast
(float32 parameters in one process, FSDP's bf16 ones in several: the same bf16 matmul), so the label logits are bf16 too (about 3 significant digits: 0.125 apart near 20).
The evaluator serves the target in float32 and accepts a draft token only where it equals the float32 argmax.
On an eval run's own outputs (EVAL_DIR: baseline.request.json + baseline.result.json, the float32 greedy outputs),
this script scores four ways of making the label against that float32 argmax:

  bf16 forward, bf16 head   what the GPU runs train on (the forward here is the CPU's bf16, not the GPU's)
  fp32 forward, bf16 head   only the storage of h and the head in bf16
  bf16 forward, fp32 head   the bf16 hidden states as extracted, the head upcast (a fix with no new data)
  fp32 forward, fp32 head   the served target itself (a check: agrees everywhere)

For each: the share of output positions whose label top-1 is not the float32 argmax, where bf16 logits tie at the
top (argmax then takes the lowest id), the label's mean probability on the float32 argmax, and, with --draft, the
draft's teacher-forced step-0 top-1 at the positions where the training label disagrees (does the draft follow the
label it was taught, or the target it is served against?), and how close the served target's own top two are there
(the gap of their float32 probabilities: near-ties, or real errors?).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

WAYS = ("bf16 forward, bf16 head", "fp32 forward, bf16 head", "bf16 forward, fp32 head", "fp32 forward, fp32 head")


def head(h, norm_w, lm_w, eps: float, dtype):
    """The verifier's norm and lm_head as speculators computes them at `dtype` (LlamaRMSNorm: statistics in fp32,
    the result cast back before the weight; the matmul at `dtype`, as autocast runs it)."""
    import torch

    x = h.to(dtype).float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = norm_w.to(dtype) * x.to(dtype)
    return (x @ lm_w.to(dtype).T).float()


def _quantiles(xs: list[float]) -> dict | None:
    """Median and 90th percentile of xs (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    return {"median": round(xs[len(xs) // 2], 4), "p90": round(xs[int(len(xs) * 0.9)], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("eval_dirs", type=Path, nargs="+")
    ap.add_argument("--draft", type=Path, help="a drafter checkpoint to score at the disagreeing positions")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from pipeline.env import setup_env

    setup_env()
    import torch

    from pipeline.engines.hf_engine import capture_layers, decoder_layers, load_target
    from pipeline.engines.hf_spec_eval import Eagle3Draft

    torch.set_num_threads(2)
    report = {}
    for eval_dir in a.eval_dirs:
        req = json.loads((eval_dir / "baseline.request.json").read_text())
        res = json.loads((eval_dir / "baseline.result.json").read_text())
        assert req["dtype"] == "float32", f"{eval_dir}: the served target ran in {req['dtype']}, not float32"
        t32 = load_target(req["model"], "float32", dev=torch.device("cpu"))
        t16 = load_target(req["model"], "bfloat16", dev=torch.device("cpu"))
        n_layers = len(decoder_layers(t32))
        norm_w, lm_w = t32.model.norm.weight.detach(), t32.lm_head.weight.detach()
        eps = t32.config.rms_norm_eps
        draft = Eagle3Draft(a.draft, t32, torch.float32, torch.device("cpu")) if a.draft else None
        ids = sorted({n_layers} | set(draft.aux_ids if draft else ()))
        c = {w: {"positions": 0, "disagree": 0, "top_ties": 0, "p_on_target": 0.0, "gaps": []} for w in WAYS}
        follow = {w: {"at": 0, "draft_eq_target": 0, "draft_eq_label": 0} for w in WAYS[:3]}
        served_eq_logits = [0, 0]
        for prompt, output in zip(req["prompts"], res["outputs"]):
            seq = torch.tensor([prompt + output])
            with torch.no_grad():
                with capture_layers(t32, ids) as g32:
                    logits32 = t32(input_ids=seq).logits[0].float()
                with capture_layers(t16, [n_layers]) as g16:
                    t16(input_ids=seq)
                h32, h16 = g32[n_layers][0], g16[n_layers][0]
                label = {WAYS[0]: head(h16, norm_w, lm_w, eps, torch.bfloat16),
                         WAYS[1]: head(h32, norm_w, lm_w, eps, torch.bfloat16),
                         WAYS[2]: head(h16, norm_w, lm_w, eps, torch.float32),
                         WAYS[3]: head(h32, norm_w, lm_w, eps, torch.float32)}
                pred = None
                if draft is not None:
                    aux = torch.cat([g32[i][0] for i in draft.aux_ids], -1)
                    draft.reset()
                    post, _ = draft.forward(seq[0, 1:], draft.combine(aux[:-1]), torch.arange(seq.shape[1] - 1))
                    pred = draft.argmax(post)  # [i] predicts token i + 2
            target = logits32.argmax(-1)  # [i] = the served target's choice of token i + 1
            # positions whose next token is an output token from the second on (the first is the target's own)
            pos = torch.arange(len(prompt), seq.shape[1] - 1)
            out_next = seq[0, pos + 1]
            served_eq_logits[0] += int((target[pos] == out_next).sum())
            served_eq_logits[1] += len(pos)
            for w, lg in label.items():
                top = lg[pos].argmax(-1)
                mx = lg[pos].max(-1, keepdim=True).values
                dis = top != target[pos]
                c[w]["positions"] += len(pos)
                c[w]["disagree"] += int(dis.sum())
                c[w]["top_ties"] += int(((lg[pos] == mx).sum(-1) > 1).sum())
                c[w]["p_on_target"] += float(lg[pos].softmax(-1).gather(-1, target[pos, None]).sum())
                top2 = logits32[pos[dis]].softmax(-1).topk(2, -1).values  # the served target's own top two there
                c[w]["gaps"] += (top2[:, 0] - top2[:, 1]).tolist()
                if pred is not None and w in follow:
                    at = pos[dis] - 1  # pred[i] predicts token i + 2: the label at position p is pred[p - 1]
                    follow[w]["at"] += len(at)
                    follow[w]["draft_eq_target"] += int((pred[at] == target[at + 1]).sum())
                    follow[w]["draft_eq_label"] += int((pred[at] == top[dis]).sum())
        rows = {w: {"positions": v["positions"], "disagree_share": round(v["disagree"] / v["positions"], 5),
                    "top_tie_share": round(v["top_ties"] / v["positions"], 5),
                    "mean_p_on_target": round(v["p_on_target"] / v["positions"], 5),
                    "target_top1_minus_top2_at_disagreements": _quantiles(v["gaps"])} for w, v in c.items()}
        for w, f in follow.items():
            rows[w]["draft_at_disagreements"] = f
        report[str(eval_dir)] = {"prompts": len(req["prompts"]), "served_outputs_equal_fp32_argmax":
                                 served_eq_logits, "ways": rows}
        print(json.dumps({str(eval_dir): report[str(eval_dir)]}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
