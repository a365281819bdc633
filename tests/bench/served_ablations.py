"""Every drafter of the SmolLM2 quality work served by vLLM (the CPU evaluator: MT-bench first turns, greedy, K=3),
in one table and one plot, by what changed between them (issue 15, item 4).

    .venv/bin/python tests/bench/served_ablations.py [docs/quality-served.json] [--plot docs/quality-served-ablations.png]

The figures live in docs/quality-served.json, one row per drafter with the session and the command that measured
it (NOTES.md, "Drafter quality", has each run). The drafters themselves were trained on the lent H200 and, except
the shipped one (data/drafters/), are not kept, so a fresh clone reproduces this table and plot from the recorded
figures, and the shipped drafter's own row with `make model eval CONFIG=configs/smollm2-shipped.toml`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table(rows: list[dict]) -> str:
    out = ["| drafter | data (answers, turns) | train samples | tokens | layers | draft vocab | epochs | MT-bench AL "
           "| pos 0 / 1 / 2 | held-out AL | outputs = greedy | session |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " / ".join(f"{p:.3f}" for p in r["mtbench_pos"])
        held = f"{r['heldout_al']:.3f}" if r.get("heldout_al") else "-"
        if r.get("heldout_other"):  # measured on other held-out prompts: shown, never plotted beside the rest
            held = f"({r['heldout_other']['al']:.3f} on {r['heldout_other']['prompts']})"
        tokens = f"{r['tokens'] / 1e6:.2f}M" if r.get("tokens") else "-"
        served = f" (served {r['served_vocab']:,})" if r.get("served_vocab") else ""
        data = f"{r['answers']}, {r['turns']}" + (f", {r['sources']}" if r.get("sources") else "")
        out.append(f"| {r['name']} | {data} | {r['train_samples']:,} | {tokens} "
                   f"| {r['layers']} | {r['vocab']:,}{served} | {r['epochs']} | {r['mtbench_al']:.3f} | {pos} | {held} "
                   f"| {r['identical']} | {r['session']} |")
    return "\n".join(out)


def plot(rows: list[dict], axes: list[dict], path: Path) -> None:
    import sys

    sys.path.insert(0, str(ROOT))
    from pipeline.env import setup_env

    setup_env()  # matplotlib's cache inside the repo, not in $HOME
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {r["name"]: r for r in rows}
    cols = min(len(axes), 4)  # panels wrap at four per row
    rows_n = -(-len(axes) // cols)
    fig, grid = plt.subplots(rows_n, cols, figsize=(3.6 * cols, 3.8 * rows_n), sharey=True, squeeze=False)
    subplots = list(grid.flat)
    for ax in subplots[len(axes):]:
        ax.axis("off")
    for ax, a in zip(subplots, axes):
        rs = [by_name[n] for n, _ in a["drafters"]]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["mtbench_al"] for r in rs], 0.4, label="MT-bench")
        ax.bar([x + 0.2 for x in xs], [r.get("heldout_al") or 0 for r in rs], 0.4, label="held-out ShareGPT")
        for x, r in zip(xs, rs):
            ax.annotate(f"{r['mtbench_al']:.2f}", (x - 0.2, r["mtbench_al"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [label for _, label in a["drafters"]], fontsize=7)
        ax.axhline(2.7, color="red", lw=0.8, ls="--")
        ax.set_title(a["title"], fontsize=9)
        ax.set_ylim(1, 2.9)
    for row in grid:
        row[0].set_ylabel("served AL (vLLM, K=3)")
    subplots[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("SmolLM2-135M-Instruct drafters: what moved served acceptance (red: the 2.7 target)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # the top 0.45 inch for the title, clear of
    fig.savefig(path, dpi=110)                                          # the first row's panel titles
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data", type=Path, nargs="?", default=ROOT / "docs" / "quality-served.json")
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    d = json.loads(a.data.read_text())
    print(table(d["drafters"]))
    if a.plot:
        plot(d["drafters"], d["axes"], a.plot)
        print(f"plot: {a.plot}")
