"""`eval` step: how much the trained drafter accelerates the target, measured by vLLM.

Three greedy runs over the same MT-bench first turns (or, with eval.prompts = "heldout", the first turns of
this run's eval split), each in its own vLLM process:
  baseline   the target alone
  trained    the target + the trained EAGLE-3 draft (method eagle3, num_speculative_tokens = K)
  untrained  the target + a randomly initialised draft of the same shape (the floor)
From vLLM's spec-decode counters: acceptance rate = accepted / draft tokens, mean acceptance length
AL = 1 + accepted / drafts (bonus token included, max K + 1), per-position acceptance =
accepted_at_pos / drafts. Speculative outputs must equal the baseline's token for token.
Writes eval.json, eval.md and acceptance.png.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .chat import prompt_ids
from .config import REPO_ROOT, Config
from .datasets import load_mtbench
from .manifest import StepError, require_manifest


def spec_metrics(spec: dict, k: int) -> dict:
    drafts, drafted, accepted = spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]
    per_pos = spec.get("accepted_per_pos") or []
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "acceptance_length": round(1 + accepted / drafts, 4) if drafts else 1.0,
        "per_position_acceptance": [round(a / drafts, 4) if drafts else 0.0 for a in per_pos[:k]],
    }


def first_turns(cfg: Config) -> list[list[dict]]:
    """The eval prompts as chat messages: MT-bench first turns, or the first user turn (with its system
    message, if any) of each conversation in this run's eval split, selected exactly as prepare selects."""
    if cfg.eval.prompts == "mtbench":
        return [[{"role": "user", "content": q["turns"][0]}] for q in load_mtbench(cfg.run.stack)][: cfg.eval.max_prompts]
    if cfg.eval.prompts != "heldout":
        raise StepError(f"eval.prompts = {cfg.eval.prompts!r} in {cfg.source_path or 'the config'}; use 'mtbench' or 'heldout'")
    from .prepare import selected_conversations, source_tags

    # a repeated copy of a conversation (data.weights > 1, "origin") is the same prompt again: counted once
    held, ids = [], set()
    source = cfg.eval.heldout_source
    tags = source_tags(cfg.data.sources)  # the tags a mix's conversations carry (none without data.sources)
    if source and source not in tags:
        raise StepError(f"eval.heldout_source = {source!r} in {cfg.source_path or 'the config'} is not a source of "
                        f"this run's data: its sources are {tags or 'one file, with no tags (drop the key)'}")
    for c in selected_conversations(cfg)[0]:
        if source and c["source"] != source:
            continue
        if c["split"] == "eval" and c.get("origin", c["id"]) not in ids:
            ids.add(c.get("origin", c["id"]))
            held.append(c)
    turns = []
    for c in held:
        first_user = next(i for i, m in enumerate(c["messages"]) if m["role"] == "user")
        turns.append(c["messages"][: first_user + 1])
    return turns[: cfg.eval.max_prompts]


def eval_prompts(cfg: Config, tok) -> list[list[int]]:
    prompts = []
    for messages in first_turns(cfg):
        ids = prompt_ids(tok, messages)
        if len(ids) + cfg.eval.max_tokens <= cfg.model.max_model_len:  # a held-out prompt may be long
            prompts.append(ids)
    return prompts


SET_NAMES = {"mtbench": "MT-bench first turns", "heldout": "held-out first turns of the training data"}
ENGINES = {"vllm": "pipeline.engines.vllm_eval", "hf": "pipeline.engines.hf_spec_eval"}


def set_name(r: dict) -> str:
    name = SET_NAMES[r.get("prompt_set", "mtbench")]
    return f"{name} (source {r['heldout_source']} alone)" if r.get("heldout_source") else name


def run_engine(name: str, request: dict, out: Path, engine: str = "vllm") -> dict:
    """One run in its own process; both engines take the same request and write the same result."""
    req, res, log = out / f"{name}.request.json", out / f"{name}.result.json", out / f"{name}.log"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    print(f"[eval] {name}: starting {engine} engine (log: {log})")
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", ENGINES[engine], str(req), str(res)],
                            cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not res.exists():
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-25:])
        raise StepError(f"{engine} run '{name}' failed (exit {rc}); log {log}, last lines:\n    {tail}")
    return json.loads(res.read_text())


def check_checkpoint(path: Path, what: str, fix: str = "run `make train` first") -> None:
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).exists()]
    if missing:
        raise StepError(f"{what} checkpoint {path} is missing {missing}; {fix}")


def trained_on(cfg: Config) -> dict:
    """The summary that says which target precision produced the training's hidden states: extract's, or train's
    own when train computed them (train.hidden_states = "stream": there is no extract step)."""
    return require_manifest(cfg, "train" if cfg.train.hidden_states == "stream" else "extract")["summary"]


def check_precision(cfg: Config, extract_summary: dict) -> None:
    """Refuse to evaluate on a target precision other than the one whose hidden states trained the draft
    (e.g. INT4 Kimi-K2.5 vs a BF16 copy), unless eval.allow_precision_mismatch."""
    data_precision = extract_summary.get("precision", cfg.model.precision)
    if data_precision != cfg.model.precision and not cfg.eval.allow_precision_mismatch:
        raise StepError(
            f"the drafter was trained on hidden states of a '{data_precision}' target but eval would run a "
            f"'{cfg.model.precision}' target; acceptance drops when precisions differ. Set "
            f"eval.allow_precision_mismatch = true to evaluate anyway."
        )


def evaluate_drafts(cfg: Config, drafts: dict[str, Path], out: Path) -> dict:
    """The baseline and one speculative run per draft on the config's prompts (eval.prompts); writes
    eval.json, eval.md and acceptance.png into `out` and returns the report."""
    from transformers import AutoTokenizer

    k = cfg.eval.num_speculative_tokens
    tok = AutoTokenizer.from_pretrained(cfg.model_path, trust_remote_code=cfg.model.trust_remote_code)
    prompts = eval_prompts(cfg, tok)
    base_req = {
        "model": str(cfg.model_path), "max_model_len": cfg.model.max_model_len, "dtype": cfg.eval.dtype,
        "seed": cfg.run.seed, "prompts": prompts, "max_tokens": cfg.eval.max_tokens,
        "trust_remote_code": cfg.model.trust_remote_code,
        # [engine]: parallelism and memory for vLLM (the hf engine ignores them)
        "engine": cfg.engine.llm_kwargs(), "enforce_eager": cfg.engine.enforce_eager,
        "batch_size": cfg.eval.hf_batch_size,  # the hf engine's batch (vLLM's own scheduler ignores it)
    }
    runs = {"baseline": run_engine("baseline", base_req, out, cfg.eval.engine)}
    for name, ckpt in drafts.items():
        spec = {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": k}
        runs[name] = run_engine(name, {**base_req, "speculative_config": spec}, out, cfg.eval.engine)
    base = runs["baseline"]
    report = {
        "engine": cfg.eval.engine, "prompt_set": cfg.eval.prompts,
        **({"heldout_source": cfg.eval.heldout_source} if cfg.eval.heldout_source else {}), "prompts": len(prompts), "max_tokens": cfg.eval.max_tokens,
        "num_speculative_tokens": k, "dtype": cfg.eval.dtype,
        "baseline_tokens_per_s": round(base["output_tokens"] / base["generation_s"], 1),
        "drafters": {},
    }
    for name in drafts:
        r = runs[name]
        same = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(r["outputs"], base["outputs"]) if a != b]
        m = spec_metrics(r["spec_decode"], k)
        m.update({
            "tokens_per_s": round(r["output_tokens"] / r["generation_s"], 1),
            "speedup": round((r["output_tokens"] / r["generation_s"]) / (base["output_tokens"] / base["generation_s"]), 3),
            "outputs_identical_to_baseline": f"{same}/{len(prompts)}",
            "all_outputs_identical": same == len(prompts),
            "first_difference_positions": first_diff,
        })
        report["drafters"][name] = m
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "eval.md").write_text(markdown(report))
    plot(report, out / "acceptance.png")
    return report


def given_draft(cfg: Config) -> Path:
    """The drafter folder eval.draft names (relative to the repository), checked."""
    p = cfg.path(cfg.eval.draft)
    if not p.is_dir():
        raise StepError(f"eval.draft = {cfg.eval.draft!r} in {cfg.source_path or 'the config'}: no such folder ({p})")
    check_checkpoint(p, f"eval.draft ({cfg.eval.draft})",
                     "point eval.draft at a folder written by `python -m pipeline.ship` or `pipeline.draft_transfer ship`")
    return p


def run(cfg: Config, out: Path) -> dict:
    if cfg.eval.draft:  # a drafter made elsewhere: no train/extract step of this run behind it, so no floor
        drafts = {Path(cfg.eval.draft).name: given_draft(cfg)}
    else:
        require_manifest(cfg, "train")
        drafts = {"trained": cfg.step_dir("train") / "checkpoint"}
        check_checkpoint(drafts["trained"], "trained draft")
        check_precision(cfg, trained_on(cfg))
        if cfg.eval.untrained_floor:
            drafts["untrained"] = cfg.step_dir("train") / "untrained"
            check_checkpoint(drafts["untrained"], "untrained draft")
    report = evaluate_drafts(cfg, drafts, out)
    t = report["drafters"][next(iter(drafts))]
    summary = {
        "acceptance_length": t["acceptance_length"],
        "acceptance_rate": t["acceptance_rate"],
        "per_position_acceptance": t["per_position_acceptance"],
        "outputs_identical_to_baseline": t["outputs_identical_to_baseline"],
        "tokens_per_s_baseline": report["baseline_tokens_per_s"],
        "tokens_per_s_speculative": t["tokens_per_s"],
        **({"draft": cfg.eval.draft} if cfg.eval.draft else {}),
    }
    if "untrained" in report["drafters"]:
        summary["untrained_acceptance_length"] = report["drafters"]["untrained"]["acceptance_length"]
    return {"summary": summary}


def markdown(r: dict) -> str:
    k = r["num_speculative_tokens"]
    lines = [
        f"# Acceptance on {set_name(r)} ({r['prompts']} prompts, greedy, K={k}, max_tokens={r['max_tokens']}, {r['dtype']})",
        "",
        "| drafter | AL (1 + acc/drafts) | acceptance rate | " + " | ".join(f"pos {i}" for i in range(k))
        + " | tok/s | speedup | outputs = baseline |",
        "|---|---|---|" + "---|" * k + "---|---|---|",
    ]
    for name, m in r["drafters"].items():
        pos = " | ".join(f"{p:.3f}" for p in m["per_position_acceptance"]) or " | ".join("-" * k)
        lines.append(f"| {name} | {m['acceptance_length']:.3f} | {m['acceptance_rate']:.3f} | {pos} | {m['tokens_per_s']} | "
                     f"{m['speedup']}x | {m['outputs_identical_to_baseline']} |")
    lines += ["", f"Baseline (target alone): {r['baseline_tokens_per_s']} output tokens/s.", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = r["num_speculative_tokens"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(r["drafters"]), 1)
    for j, (name, m) in enumerate(r["drafters"].items()):
        xs = [i + j * width for i in range(k)]
        ax.bar(xs, m["per_position_acceptance"], width, label=f"{name} (AL {m['acceptance_length']:.2f})")
    ax.set_xticks([i + width * (len(r["drafters"]) - 1) / 2 for i in range(k)], [f"pos {i}" for i in range(k)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted / drafts")
    ax.set_title(f"Per-position acceptance, {set_name(r)} ({r['prompts']} prompts, K={k})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    # Evaluate checkpoints made elsewhere (e.g. trained on a GPU machine and brought back):
    #   python -m pipeline.evaluate --config C [--set eval.prompts=heldout] --out DIR name=CKPT_DIR [...]
    import argparse

    from .__main__ import parse_set
    from .config import ConfigError, load_config
    from .env import setup_env
    from .model import require_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    ap.add_argument("drafts", nargs="+", metavar="NAME=CKPT_DIR")
    a = ap.parse_args()
    setup_env()
    if bad := [d for d in a.drafts if "=" not in d]:
        ap.error(f"{bad[0]!r}: give each drafter as NAME=FOLDER")
    ds = {n: Path(p) for n, p in (d.split("=", 1) for d in a.drafts)}
    try:
        c = load_config(a.config, parse_set(a.set))
        require_target(c)
        for n, p in ds.items():
            check_checkpoint(p, n, "give the folder of a checkpoint or of a slim drafter")
    except (ConfigError, StepError) as e:
        sys.exit(f"[evaluate] error: {e}")
    o = Path(a.out)
    o.mkdir(parents=True, exist_ok=True)
    print(markdown(evaluate_drafts(c, ds, o)))
