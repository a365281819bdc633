"""Served acceptance (the vLLM evaluator, on CPU) of drafts trained on the H200, beside their training-time proxy.

  python tests/bench/h200/served.py EVAL_DIR RESULTS_DIR DRAFTER=RUN [...] [--plot docs/quality-served.png]

EVAL_DIR: `python -m pipeline.evaluate ... --out EVAL_DIR NAME=CKPT ...` (its eval.json); RESULTS_DIR: run.sh's
results unpacked (runs/<RUN>/train/metrics.jsonl, manifest.json). DRAFTER=RUN pairs an evaluated drafter with
the run that trained it. The proxy is ablations.py's: 1 + the three cumulative val accuracies of the last epoch,
on the run's own eval split (so a run trained on other answers is scored on other text).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ablations import load, save


def rows(eval_dir: Path, results: Path, pairs: dict[str, str]) -> list[dict]:
    served = json.loads((eval_dir / "eval.json").read_text())["drafters"]
    trained = load(results)
    out = []
    for drafter, run in pairs.items():
        s, t = served[drafter], trained[run]
        out.append({"drafter": drafter, "run": run, "train_samples": t["train_samples"], "epochs": t["epochs"],
                    "proxy_al": t["proxy_al"], "al": s["acceptance_length"], "pos": s["per_position_acceptance"],
                    "identical": s["outputs_identical_to_baseline"]})
    return out


def table(rs: list[dict]) -> str:
    out = ["| drafter (run) | train samples | epochs | val proxy | served AL | pos 0 / 1 / 2 | outputs = greedy |",
           "|---|---|---|---|---|---|---|"]
    for r in rs:
        pos = " / ".join(f"{p:.3f}" for p in r["pos"])
        out.append(f"| {r['drafter']} ({r['run']}) | {r['train_samples']} | {r['epochs']} | {r['proxy_al']:.2f} "
                   f"| {r['al']:.3f} | {pos} | {r['identical']} |")
    return "\n".join(out)


def plot(rs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rs:
        a.plot(r["proxy_al"], r["al"], "o")
        a.annotate(r["drafter"], (r["proxy_al"], r["al"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    lo, hi = 1.0, max(r["proxy_al"] for r in rs) + 0.2
    a.plot([lo, hi], [lo, hi], ":", color="grey", label="served = proxy")
    a.axhline(2.7, color="red", lw=0.8, ls="--", label="target AL 2.7")
    a.set_xlabel("training-time proxy (1 + val accuracies)")
    a.set_ylabel("served AL, MT-bench (vLLM)")
    a.set_title("Served acceptance vs the training-time proxy")
    a.legend(fontsize=7)
    width = 0.8 / len(rs)
    for i, r in enumerate(rs):
        b.bar([k + i * width for k in range(3)], r["pos"], width, label=f"{r['drafter']} (AL {r['al']:.2f})")
    b.set_xticks([k + 0.4 - width / 2 for k in range(3)], ["pos 0", "pos 1", "pos 2"])
    b.set_ylabel("acceptance (cumulative)")
    b.set_title("Per-position acceptance, MT-bench, K=3")
    b.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("pairs", nargs="+", metavar="DRAFTER=RUN")
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    rs = rows(a.eval_dir, a.results, dict(p.split("=", 1) for p in a.pairs))
    print(table(rs))
    if a.plot:
        plot(rs, a.plot)
