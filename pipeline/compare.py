"""Compare two runs step by step: identical, or the first step where they diverge and by how much.

    python -m pipeline.compare runs/a runs/b [--max-files N] [--json out.json]
    make compare RUN_A=runs/a RUN_B=runs/b

Per step (in pipeline order): both manifests' inputs and outputs, then the contents:
  extract   every hidden-state file present in both: token ids equal?, max |a-b|, min and mean per-token
            cosine, worst per-file per-layer mean cosine (verify's statistic); the manifests' outputs_hash
            (content hashes) says whether anything differs, the contents say by how much
  train     the final checkpoint's tensors: max |a-b| and cosine per tensor, worst tensor named
  eval      numeric metric deltas of eval.json (b - a)
  others    files whose bytes differ
Exit status 0 when every step present in either run is identical, 1 when they diverge, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import what_it_computes
from .manifest import MANIFEST, read_manifest, sha256_file

ORDER = ["model", "prepare", "extract", "verify", "vocab", "train", "eval", "report"]
SPLITS = ("train", "eval")
# Files that legitimately differ between two runs of the same computation (logs, timings, plots).
VOLATILE = {MANIFEST, ".fingerprint", "server.log", "train.log", "untrained.log", "curves.png", "acceptance.png",
            "baseline.log", "trained.log", "report.md",
            "state.json"}  # datasets' state.json carries a random fingerprint for datasets built in memory


def _files(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in VOLATILE and not p.name.endswith((".tmp", ".log")):
            out[str(p.relative_to(root))] = sha256_file(p)
    return out


def compare_files(a: Path, b: Path) -> dict:
    fa, fb = _files(a), _files(b)
    return {
        "only_in_a": sorted(set(fa) - set(fb)),
        "only_in_b": sorted(set(fb) - set(fa)),
        "different": sorted(k for k in set(fa) & set(fb) if fa[k] != fb[k]),
        "same": sum(1 for k in set(fa) & set(fb) if fa[k] == fb[k]),
    }


def _tensor_diff(x, y) -> dict:
    import torch

    if x.shape != y.shape:
        return {"shape_a": list(x.shape), "shape_b": list(y.shape)}
    if not x.is_floating_point():
        return {"equal": bool(torch.equal(x, y)), "mismatches": int((x != y).sum())}
    x, y = x.double(), y.double()
    d = {"equal": bool(torch.equal(x, y)), "max_abs_diff": float((x - y).abs().max()) if x.numel() else 0.0}
    flat_cos = torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0) if x.numel() else torch.tensor(1.0)
    d["cosine"] = float(flat_cos)
    return d


def compare_extract(a: Path, b: Path, max_files: int = 0) -> dict:
    import torch
    from safetensors.torch import load_file

    names_a = {f"{s}/{p.name}" for s in SPLITS if (a / s).is_dir() for p in (a / s).glob("hs_*.safetensors")}
    names_b = {f"{s}/{p.name}" for s in SPLITS if (b / s).is_dir() for p in (b / s).glob("hs_*.safetensors")}
    common = sorted(names_a & names_b)
    if max_files > 0:
        common = common[:max_files]
    worst = {"file": None, "max_abs_diff": 0.0, "min_token_cosine": 1.0, "min_layer_mean_cosine": 1.0}
    identical, token_mismatch, shape_mismatch, cos_sum, cos_n, below = 0, [], [], 0.0, 0, 0
    for name in common:
        if sha256_file(a / name) == sha256_file(b / name):
            identical += 1
            continue
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        if not torch.equal(ta["token_ids"], tb["token_ids"]):
            token_mismatch.append(name)
            continue
        ha, hb = ta["hidden_states"].float(), tb["hidden_states"].float()
        if ha.shape != hb.shape:
            shape_mismatch.append(name)
            continue
        diff = float((ha - hb).abs().max())
        cos = torch.nn.functional.cosine_similarity(ha, hb, dim=-1)  # [T, L]
        cos_sum += float(cos.sum())
        cos_n += cos.numel()
        below += int((cos < 0.999).sum())
        worst["min_layer_mean_cosine"] = min(worst["min_layer_mean_cosine"], float(cos.mean(0).min()))
        if diff > worst["max_abs_diff"]:
            worst.update(file=name, max_abs_diff=diff)
        worst["min_token_cosine"] = min(worst["min_token_cosine"], float(cos.min()))
    compared = len(common)
    return {
        "files_compared": compared,
        "bit_identical": identical,
        "only_in_a": sorted(names_a - names_b),
        "only_in_b": sorted(names_b - names_a),
        "token_ids_differ": token_mismatch,
        "shape_differs": shape_mismatch,
        "max_abs_diff": worst["max_abs_diff"],
        "worst_file": worst["file"],
        "min_token_cosine": worst["min_token_cosine"],
        "mean_token_cosine_of_differing": round(cos_sum / cos_n, 8) if cos_n else None,
        # verify's statistic (a layer's mean per-token cosine in one file), worst over differing files and layers
        "min_layer_mean_cosine": worst["min_layer_mean_cosine"],
        "token_cosines_below_0.999": below,
        "token_cosines_compared": cos_n,
        "identical": identical == compared and names_a == names_b and compared > 0,
    }


def checkpoint_file(run_dir: Path) -> Path | None:
    p = run_dir / "train" / "checkpoint" / "model.safetensors"
    return p if p.exists() else None


def compare_checkpoints(pa: Path, pb: Path) -> dict:
    from safetensors.torch import load_file

    ta, tb = load_file(str(pa)), load_file(str(pb))
    per = {k: _tensor_diff(ta[k], tb[k]) for k in sorted(set(ta) & set(tb))}
    differing = {k: v for k, v in per.items() if not v.get("equal")}
    worst = max(differing, key=lambda k: differing[k].get("max_abs_diff", float("inf")), default=None)
    return {
        "tensors": len(per),
        "only_in_a": sorted(set(ta) - set(tb)),
        "only_in_b": sorted(set(tb) - set(ta)),
        "differing_tensors": len(differing),
        "worst_tensor": worst,
        "worst": differing.get(worst) if worst else None,
        "min_cosine": min((v["cosine"] for v in differing.values() if "cosine" in v), default=1.0),
        "identical": not differing and set(ta) == set(tb),
    }


def _numeric_leaves(obj, prefix="") -> dict[str, float]:
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_numeric_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_numeric_leaves(v, f"{prefix}[{i}]"))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (str, bool)):
        out[prefix] = obj
    return out


def compare_eval(pa: Path, pb: Path) -> dict:
    la, lb = _numeric_leaves(json.loads(pa.read_text())), _numeric_leaves(json.loads(pb.read_text()))
    deltas, changed = {}, {}
    for k in sorted(set(la) | set(lb)):
        va, vb = la.get(k), lb.get(k)
        if va == vb:
            continue
        if isinstance(va, float) and isinstance(vb, float):
            deltas[k] = round(vb - va, 6)
        else:
            changed[k] = [va, vb]
    # speed numbers (tokens/s) are timings, not results: reported, but do not make runs "different"
    timing = {k for k in deltas if "tokens_per_s" in k or "speedup" in k}
    return {"deltas": deltas, "changed": changed, "timing_only": sorted(timing),
            "identical": not changed and set(deltas) <= timing}


def _what_it_computes(m: dict) -> dict | None:
    """A manifest's config sections as its fingerprint saw them (config.what_it_computes)."""
    sections = m.get("config_sections")
    return what_it_computes(sections) if isinstance(sections, dict) else sections


def compare_runs(a: Path, b: Path, max_files: int = 0) -> dict:
    steps = []
    first = None
    for step in ORDER:
        da, db = a / step, b / step
        ma, mb = read_manifest(da), read_manifest(db)
        row: dict = {"step": step}
        if ma is None and mb is None:
            row["status"] = "absent in both"
            steps.append(row)
            continue
        if ma is None or mb is None:
            row["status"] = f"complete only in {'b' if ma is None else 'a'}"
            row["identical"] = False
        else:
            row["same_config_sections"] = _what_it_computes(ma) == _what_it_computes(mb)
            row["same_inputs"] = ma.get("inputs") == mb.get("inputs")
            row["same_outputs_hash"] = ma.get("outputs_hash") == mb.get("outputs_hash")
            if step == "extract":
                row["contents"] = compare_extract(da, db, max_files)
                row["identical"] = row["contents"]["identical"]
            elif step == "verify":
                row["identical"] = row["same_outputs_hash"]  # verify's output is the verified extraction
            elif step == "train" and checkpoint_file(a) and checkpoint_file(b):
                row["contents"] = compare_checkpoints(checkpoint_file(a), checkpoint_file(b))
                row["identical"] = row["contents"]["identical"]
            elif step == "eval" and (da / "eval.json").exists() and (db / "eval.json").exists():
                row["contents"] = compare_eval(da / "eval.json", db / "eval.json")
                row["identical"] = row["contents"]["identical"]
            else:
                files = compare_files(da, db)
                row["contents"] = files
                row["identical"] = row["same_outputs_hash"] or not (
                    files["only_in_a"] or files["only_in_b"] or files["different"])
            row["status"] = "identical" if row["identical"] else "DIFFERENT"
        if not row["identical"] and first is None:
            first = step
        steps.append(row)
    return {"a": str(a), "b": str(b), "first_divergent_step": first, "steps": steps}


def render(r: dict) -> str:
    lines = [f"compare {r['a']}  vs  {r['b']}"]
    for row in r["steps"]:
        line = f"  {row['step']:<8} {row['status']}"
        c = row.get("contents") or {}
        if row["step"] == "extract" and c:
            line += (f"  ({c['bit_identical']}/{c['files_compared']} files bit-identical"
                     + (f"; max |a-b| {c['max_abs_diff']:.4g} in {c['worst_file']}, min token cosine {c['min_token_cosine']:.6f}"
                        if c["worst_file"] else "")
                     + (f"; token ids differ in {len(c['token_ids_differ'])}" if c["token_ids_differ"] else "")
                     + (f"; only in a: {len(c['only_in_a'])}, only in b: {len(c['only_in_b'])}"
                        if c["only_in_a"] or c["only_in_b"] else "") + ")")
        elif row["step"] == "train" and "differing_tensors" in c:
            line += f"  ({c['differing_tensors']}/{c['tensors']} tensors differ"
            if c["worst"]:
                line += f"; worst {c['worst_tensor']}: max |a-b| {c['worst'].get('max_abs_diff', float('nan')):.4g}, cosine {c['worst'].get('cosine', float('nan')):.6f}"
            line += ")"
        elif row["step"] == "eval" and "deltas" in c:
            shown = {k: v for k, v in c["deltas"].items() if k not in c["timing_only"]}
            if shown or c["changed"]:
                line += "  (b - a: " + ", ".join(f"{k} {v:+g}" for k, v in list(shown.items())[:8])
                line += (", " if shown and c["changed"] else "") + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in list(c["changed"].items())[:4]) + ")"
        elif c.get("different") or c.get("only_in_a") or c.get("only_in_b"):
            line += f"  (files differ: {(c['different'] + c['only_in_a'] + c['only_in_b'])[:5]})"
        if row.get("same_inputs") is False:
            line += "  [inputs differ]"
        if row.get("same_config_sections") is False:
            line += "  [config differs]"
        lines.append(line)
    lines.append(f"first divergent step: {r['first_divergent_step']}" if r["first_divergent_step"]
                 else "runs are identical (every step present is the same)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--max-files", type=int, default=0, help="compare at most N hidden-state files (0 = all)")
    ap.add_argument("--json", help="also write the full comparison here")
    args = ap.parse_args(argv)
    a, b = Path(args.run_a), Path(args.run_b)
    for p in (a, b):
        if not p.is_dir():
            print(f"error: {p} is not a run folder (runs/<name>)", file=sys.stderr)
            return 2
    r = compare_runs(a, b, args.max_files)
    print(render(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=str) + "\n")
    return 0 if r["first_divergent_step"] is None else 1


if __name__ == "__main__":
    from .env import setup_env

    setup_env()
    sys.exit(main())
