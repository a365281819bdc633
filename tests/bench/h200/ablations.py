"""Tables and a plot of the drafter-quality ablations (tests/bench/h200/run.sh train) from their training metrics.

  python tests/bench/h200/ablations.py RESULTS_DIR [--plot docs/quality-ablations.png]

RESULTS_DIR holds runs/<name>/train/{manifest.json,metrics.jsonl} as unpacked from run.sh's results.tgz.
Reported per run: train samples, epochs, held-out val accuracy per TTT position (speculators' full_acc_k:
position k counts only when positions < k were right, so it is cumulative like vLLM's per-position
acceptance) and 1 + their sum, the acceptance length those accuracies would give if served drafts were
accepted as often as teacher-forced val tokens are predicted. That is a training-time proxy: NOTES.md
measures how far served acceptance falls below it.
"""
from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

RECIPE = tomllib.loads((Path(__file__).resolve().parents[3] / "configs/smollm2-quality-h200.toml").read_text())
ORDER = ["abl-n500", "abl-n2000", "abl-n8000", "smollm2-quality-h200",
         "abl-ttt1", "abl-ttt5", "abl-v4096", "abl-v32768", "abl-original",
         # session 4: full 8-epoch schedule; a 2-layer draft; served-ablation runs (their drafts came back)
         "smollm2-quality-h200-l2", "abl-n2000-e8", "abl-original-all"]


def load(results: Path) -> dict[str, dict]:
    rows = {}
    for name in ORDER:
        d = results / "runs" / name / "train"
        if not (d / "metrics.jsonl").exists():
            continue
        val = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "val" in r]
        man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        cfg = man.get("config_sections") or RECIPE  # a run stopped by the time limit has no manifest
        if not man:
            prep = json.loads((results / "runs" / name / "prepare" / "manifest.json").read_text())
            man = {"summary": {"train_samples": prep["summary"]["train_samples"]}}
        last = val[-1]["val"] if val else {}
        acc = [last[k] for k in sorted(last) if k.startswith("full_acc_") and k.endswith("_epoch")]
        rows[name] = {
            "train_samples": man.get("summary", {}).get("train_samples"),
            "epochs": len(val),
            "ttt_steps": cfg.get("train", {}).get("ttt_steps"),
            "draft_vocab": cfg.get("vocab", {}).get("draft_vocab_size"),
            "acc": acc,
            "proxy_al": 1 + sum(acc[:3]),
            "curve": [1 + sum(v["val"].get(f"full_acc_{i}_epoch", 0.0) for i in range(3)) for v in val],
        }
    return rows


def table(rows: dict[str, dict]) -> str:
    out = ["| run | train samples | epochs | TTT | draft vocab | val acc per position | 1 + sum (first 3) |",
           "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        acc = " / ".join(f"{a:.3f}" for a in r["acc"])
        out.append(f"| {name} | {r['train_samples']} | {r['epochs']} | {r['ttt_steps']} | {r['draft_vocab']} | {acc} | {r['proxy_al']:.2f} |")
    return "\n".join(out)


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = [n for n in ("abl-n500", "abl-n2000", "abl-n8000", "smollm2-quality-h200") if n in rows]
    a.plot([rows[n]["train_samples"] for n in sizes], [rows[n]["proxy_al"] for n in sizes], "o-")
    for n in sizes:
        a.annotate(f"{rows[n]['proxy_al']:.2f}", (rows[n]["train_samples"], rows[n]["proxy_al"]),
                   textcoords="offset points", xytext=(4, -12))
    a.set_xscale("log")
    a.set_xlabel("training conversations (regenerated)")
    a.set_ylabel("1 + sum of val accuracies (K=3)")
    a.set_title("Data size (held-out val, training-time proxy)")
    for n, r in rows.items():
        b.plot(range(1, len(r["curve"]) + 1), r["curve"], "o-", label=n.removeprefix("abl-"))
    b.set_xlabel("epoch")
    b.set_title("Per-epoch proxy (first 3 positions), every run")
    b.legend(fontsize=7)
    save(fig, path)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    rows = load(a.results)
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)
