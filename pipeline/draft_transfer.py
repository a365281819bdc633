"""Move a trained draft between machines without its frozen copy of the target's embedding.

A speculators EAGLE-3 checkpoint stores `embed_tokens` (vocab x hidden, frozen, identical to the
target's input embedding): 57 MB of SmolLM2's 80 MB. `slim` writes the checkpoint without it (and
splits the weights into files below a size limit); `restore` puts the target's embedding back and
checks the result loads as the same checkpoint. Used for the GPU machine, whose outbound files are
limited in size: only what cannot be rebuilt from the target travels.

  python -m pipeline.draft_transfer slim CKPT_DIR OUT_DIR [--max-mb 15]
  python -m pipeline.draft_transfer restore SLIM_DIR TARGET_MODEL_DIR OUT_CKPT_DIR
  python -m pipeline.draft_transfer ship CKPT_OR_SLIM_DIR OUT_DIR
  python -m pipeline.draft_transfer prune SHIPPED_DIR KEEP_DRAFT_DIR OUT_DIR
  python -m pipeline.draft_transfer widen CKPT_OR_SLIM_DIR TARGET_MODEL_DIR OUT_DIR
  python -m pipeline.draft_transfer average OUT_DIR DRAFT_DIR DRAFT_DIR [...]
  python -m pipeline.draft_transfer grow DRAFT_DIR OUT_DIR

`ship` writes the form a drafter is kept and served in: config.json + one model.safetensors without the
embedding. vLLM (0.32's Eagle3LlamaForCausalLM.load_weights) and the transformers evaluator both take the
target's embedding when a draft has none, so this form needs no restore step to be served.

`widen` writes the same form over the target's whole vocabulary, without the lm_head: speculators (0.9) never
trains a draft's lm_head (it is the target's output embedding, rows of the draft vocabulary, frozen), so a draft
can propose every target token through the target's own lm_head, which vLLM then shares with it.

`average` writes the uniform mean of drafters of one shape (a "model soup") in the `ship` form: the start and the
end of a continuation averaged have served a higher MT-bench acceptance than either (NOTES, sessions 35-38).

`grow` writes the same drafter with one more decoder layer that changes nothing yet: a copy of its last layer (a new
one for a one-layer drafter) whose two output projections (self_attn.o_proj, mlp.down_proj) are zero, so the new
layer adds zero to the residual stream and the grown drafter proposes what it did. Training (`train.num_layers` one
higher, `train.init_from` the grown folder) then gives the extra capacity something to learn from where the drafter
stands, instead of from random weights.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

EMBED = "embed_tokens.weight"


def _embed_key(keys) -> str:
    found = [k for k in keys if k.endswith(EMBED)]
    if len(found) != 1:
        raise ValueError(f"expected one *{EMBED} tensor, found {found}")
    return found[0]


def slim(ckpt: Path, out: Path, max_mb: float = 15.0) -> list[Path]:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    key = _embed_key(weights)
    removed = weights.pop(key)
    shape, dtype = list(removed.shape), str(removed.dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(ckpt / "config.json", out / "config.json")
    # A tensor larger than the limit (a 16k-row lm_head is 19 MB) travels as row blocks "<name>.part<i>".
    limit = int(max_mb * 1e6)
    pieces, split = {}, {}
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > limit and t.dim() > 0:
            rows = max(1, limit // max(1, nbytes // t.shape[0]))
            chunks = torch.split(t, rows, dim=0)
            split[name] = len(chunks)
            pieces.update({f"{name}.part{i}": c for i, c in enumerate(chunks)})
        else:
            pieces[name] = t
    weights = pieces
    parts, current, size = [], {}, 0
    for name in sorted(weights):
        t = weights[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_mb * 1e6:
            parts.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    parts.append(current)
    files = []
    for i, part in enumerate(parts):
        f = out / f"weights-{i}.safetensors"
        save_file(part, str(f))
        files.append(f)
    (out / "slim.json").write_text(json.dumps({"removed": key, "shape": shape, "dtype": dtype, "split": split, "files": [f.name for f in files]}))
    return files


def _read_slim(slim_dir: Path) -> tuple[dict, dict]:
    """A slim folder's slim.json and its weights, split tensors joined again (the embedding still missing)."""
    import torch
    from safetensors.torch import load_file

    meta = json.loads((slim_dir / "slim.json").read_text())
    weights = {}
    for name in meta["files"]:
        weights.update(load_file(str(slim_dir / name)))
    for name, n in meta.get("split", {}).items():
        weights[name] = torch.cat([weights.pop(f"{name}.part{i}") for i in range(n)], dim=0)
    return meta, weights


def restore(slim_dir: Path, target: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    meta, weights = _read_slim(slim_dir)
    embed = target_input_embedding(target)
    if list(embed.shape) != meta["shape"]:
        raise ValueError(f"target embedding {list(embed.shape)} != the draft's {meta['shape']}")
    dtype = getattr(torch, meta["dtype"])
    weights[meta["removed"]] = embed.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(slim_dir / "config.json", out / "config.json")
    save_file(weights, str(out / "model.safetensors"))
    assert torch.equal(load_file(str(out / "model.safetensors"))[meta["removed"]], embed.to(dtype))
    return out


def target_input_embedding(target: Path):
    """The target's input embedding (what a speculators draft holds, frozen, as `embed_tokens.weight`)."""
    return _target_tensor(target, EMBED)


def _target_tensor(target: Path, *suffixes: str):
    """The first tensor in the target's safetensors named *suffix (vision towers' skipped), suffixes tried in order."""
    from safetensors import safe_open

    for suffix in suffixes:
        for f in sorted(target.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                found = [k for k in st.keys() if k.endswith(suffix) and "vision" not in k]
                if found:
                    return st.get_tensor(found[0])
    raise ValueError(f"{target}: no tensor named *{' nor *'.join(suffixes)} in its safetensors")


def _served_weights(src: Path) -> dict:
    """A full checkpoint's, a slim folder's or a served-form drafter's weights, without the embedding."""
    from safetensors.torch import load_file

    if (src / "slim.json").exists():
        weights = _read_slim(src)[1]
    else:
        weights = load_file(str(src / "model.safetensors"))
        if any(k.endswith(EMBED) for k in weights):  # else already in this form (e.g. from `prune`)
            weights.pop(_embed_key(weights))
    if any(k.endswith(EMBED) for k in weights):
        raise ValueError(f"{src}: still holds an embedding after removing it")
    return weights


def ship(src: Path, out: Path) -> Path:
    """A full checkpoint (model.safetensors), a slim folder (slim.json) or a drafter already in this form ->
    OUT/config.json + model.safetensors without the embedding, split tensors joined again."""
    from safetensors.torch import save_file

    weights = _served_weights(src)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def average(out: Path, drafts: list[Path], config_from: Path | None = None) -> Path:
    """The mean of the drafters' served weights (`ship` form, any form `_served_weights` reads) -> OUT. Float
    tensors are averaged uniformly in float32 and saved in their own dtype; every other tensor (the vocabulary maps
    d2t/t2d) must be equal in all of them, or they are not averageable (another draft vocabulary). config.json is
    CONFIG_FROM's (default: the first drafter's). OUT may be one of the drafters (the new files are written after
    all are read)."""
    import torch
    from safetensors.torch import save_file

    if len(drafts) < 2:
        raise ValueError(f"averaging needs two drafters or more, got {len(drafts)}")
    states = [_served_weights(d) for d in drafts]
    for d, s in zip(drafts[1:], states[1:]):
        if s.keys() != states[0].keys():
            raise ValueError(f"{d}: other tensors than {drafts[0]} ({sorted(s.keys() ^ states[0].keys())[:4]}); "
                             f"only drafters of one shape can be averaged")
    mean = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            if any(s[k].shape != v.shape for s in states):
                raise ValueError(f"{k}: shapes {[tuple(s[k].shape) for s in states]} differ between {drafts}")
            mean[k] = (sum(s[k].float() for s in states) / len(states)).to(v.dtype)
        elif all(torch.equal(s[k], v) for s in states):
            mean[k] = v
        else:
            raise ValueError(f"{k} differs between {drafts} (another draft vocabulary?): not averageable")
    config = ((config_from or drafts[0]) / "config.json").read_text()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config)
    save_file({k: v.contiguous() for k, v in mean.items()}, str(out / "model.safetensors"))
    return out


def target_output_embedding(target: Path):
    """The target's lm_head weight, or its input embedding where it has none (tied, as in SmolLM2: speculators
    takes the same fallback when it copies the head into a draft)."""
    return _target_tensor(target, "lm_head.weight", EMBED)


def widen(src: Path, target: Path, out: Path, name: str | None = None) -> Path:
    """A drafter (checkpoint, slim folder or served form) whose lm_head is the target's output embedding at its
    draft vocabulary -> the served form over the target's whole vocabulary: no lm_head, d2t or t2d, and
    draft_vocab_size = the target's vocab size. vLLM (0.32: Eagle3LlamaForCausalLM.load_weights, then
    llm_base_proposer._maybe_share_lm_head) serves a draft without an lm_head with the target's, and so does the
    transformers evaluator. The draft's logits on its old vocabulary are unchanged (bit for bit where the target
    and the draft share a dtype, as here: both bf16); it can now also propose the tokens outside it (a 6,144-token
    vocabulary covers 89 % of MT-bench's greedy output tokens, 16,384 96 %: tests/bench/vocab_coverage.py).
    Refused when the lm_head differs from the target's rows: a trained head would be lost. `name` is what error
    messages call the drafter (default: src). `out` may be `src`: the folder is replaced only once written."""
    import os

    import torch
    from safetensors.torch import save_file

    from .vocab import target_vocab_size

    name = name or str(src)
    weights = _served_weights(src)  # out may be src: the new files are written aside and moved over it
    head = target_output_embedding(target)
    vocab = target_vocab_size(target)
    conf = json.loads((src / "config.json").read_text())
    if head.shape[0] != vocab or conf.get("transformer_layer_config", {}).get("vocab_size", vocab) != vocab:
        raise ValueError(f"{name}: its verifier vocabulary ({conf.get('transformer_layer_config', {}).get('vocab_size')}), "
                         f"{target}/config.json's vocab_size ({vocab}) and the target's lm_head rows ({head.shape[0]}) "
                         f"must all agree for vLLM to serve the draft with the target's lm_head; not widened")
    t2d, d2t = weights.pop("t2d", None), weights.pop("d2t", None)
    lm_head = weights.pop("lm_head.weight", None)
    if lm_head is None:
        raise ValueError(f"{name}: has no lm_head.weight: already served over the whole vocabulary (widened); "
                         f"serve or ship it as it is (pipeline.ship without --widen)")
    if (t2d is None) != (d2t is None) or (t2d is not None and len(t2d) != vocab):
        raise ValueError(f"{name}: its vocab maps (t2d {None if t2d is None else len(t2d)} entries, d2t "
                         f"{None if d2t is None else len(d2t)}) do not fit {target}'s {vocab} tokens: another target?")
    if d2t is not None:
        ids = torch.arange(len(d2t)) + d2t.long()  # target id of each draft id (speculators' offset semantics)
        if not (bool(t2d[ids].all()) and int(t2d.sum()) == len(ids)):
            raise ValueError(f"{name}: its d2t and t2d disagree; a broken vocab map, not widened")
    else:
        ids = torch.arange(vocab)
    if lm_head.shape != (len(ids), head.shape[1]) or not torch.equal(lm_head, head[ids].to(lm_head.dtype)):
        raise ValueError(f"{name}: its lm_head is not {target}'s output embedding at its draft vocabulary (it was "
                         f"trained, or the draft belongs to another target); widening would change what it proposes: "
                         f"serve or ship it as it is (pipeline.ship without --widen)")
    conf["draft_vocab_size"] = vocab
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.widen-tmp"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    (out / "config.json.widen-tmp").write_text(json.dumps(conf, indent=2) + "\n")
    os.replace(tmp, out / "model.safetensors")
    os.replace(out / "config.json.widen-tmp", out / "config.json")
    return out


def prune(src: Path, keep: Path, out: Path) -> Path:
    """A shipped-form drafter (SRC) cut down to the draft vocabulary of KEEP (another drafter's folder), which must
    be a subset of SRC's: the lm_head rows of the kept target ids, d2t/t2d rebuilt. The drafter proposes the same
    token as before wherever its choice is in the kept set; it only loses the rare tokens (a 16k-token draft trained, then shipped with the 6,144 most frequent)."""
    import torch
    from safetensors.torch import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    t2d_keep = load_file(str(keep / "model.safetensors"))["t2d"]
    if len(t2d_keep) != len(w["t2d"]):  # t2d spans the target's whole vocabulary
        raise ValueError(f"{keep}: its t2d covers {len(t2d_keep)} target tokens, {src}'s {len(w['t2d'])}: drafters "
                         f"of different targets")
    src_ids = torch.arange(len(w["d2t"])) + w["d2t"]  # target id of each draft id (ascending)
    if not bool(t2d_keep[src_ids].sum() == t2d_keep.sum()):
        raise ValueError(f"{keep}: its draft vocabulary is not a subset of {src}'s")
    rows = t2d_keep[src_ids].nonzero().squeeze(1)
    kept_ids = src_ids[rows]
    w["lm_head.weight"] = w["lm_head.weight"][rows].contiguous()
    w["d2t"] = kept_ids - torch.arange(len(kept_ids))
    w["t2d"] = t2d_keep.clone()
    config = json.loads((src / "config.json").read_text())
    config["draft_vocab_size"] = len(kept_ids)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(w, str(out / "model.safetensors"))
    return out


ZEROED = ("self_attn.o_proj", "mlp.down_proj")  # a new layer's outputs into the residual stream (weight, any bias)
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def grow(src: Path, out: Path, seed: int = 0) -> Path:
    """SRC (any form `_served_weights` reads) with one more decoder layer -> OUT in the `ship` form (`grown`'s
    files). OUT must be a new folder: not SRC, a slim folder or a shipped drafter's."""
    if out.resolve() == src.resolve() or any((out / f).exists() for f in ("slim.json", "results.json")):
        raise ValueError(f"{out}: grow writes a new folder, not {src} itself, a slim folder or a shipped drafter's: "
                         f"name another OUT")
    files = grown(src, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out


def grown(src: Path, seed: int = 0) -> dict[str, bytes]:
    """The bytes of SRC grown by one decoder layer: {"config.json": ..., "model.safetensors": ...}. The new layer's
    output projections (ZEROED, weights and biases) are zero, so it adds zero to the residual stream: the grown
    drafter computes what SRC does, exactly in float32 (the CPU evaluator: session 50 served both with the same
    counters on all 80 MT-bench prompts) and up to the rounding of one residual sum in bf16. The new layer is a copy
    of the last one where that reads the residual stream (two layers or more). A one-layer drafter's only layer
    reads the token embedding joined to the fc's output (twice as wide, and a `hidden_norm`), so its new layer has
    layer 0's tensors at the residual stream's width, at random (normal, the config's initializer_range; norms one)
    as speculators initialises a layer. The same SRC, seed, torch and safetensors give the same bytes
    (`ship.grown_record` compares them with a run's start)."""
    import torch
    from safetensors.torch import save

    weights = _served_weights(src)
    config = json.loads((src / "config.json").read_text())
    layer = config["transformer_layer_config"]
    n = layer["num_hidden_layers"]
    held = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
    if held != list(range(n)):
        raise ValueError(f"{src}: config.json says {n} decoder layers, its weights hold layers {held}")
    last = {k.removeprefix(f"layers.{n - 1}."): v for k, v in weights.items() if k.startswith(f"layers.{n - 1}.")}
    if n >= 2:
        new = {k: v.clone() for k, v in last.items()}
    else:
        g = torch.Generator().manual_seed(seed)
        new = {}
        for k, v in last.items():
            if k == "hidden_norm.weight":
                continue
            shape = (v.shape[0], v.shape[1] // 2) if k in QKV else tuple(v.shape)
            new[k] = (torch.ones(shape) if v.dim() == 1 else
                      torch.randn(shape, generator=g) * layer.get("initializer_range", 0.02)).to(v.dtype)
    for k in new:
        if k.rsplit(".", 1)[0] in ZEROED:
            new[k] = torch.zeros_like(new[k])
    weights |= {f"layers.{n}.{k}": v for k, v in new.items()}
    layer["num_hidden_layers"] = n + 1
    if isinstance(layer.get("layer_types"), list):
        layer["layer_types"] = layer["layer_types"] + layer["layer_types"][-1:]
    return {"config.json": (json.dumps(config, indent=2) + "\n").encode(),
            "model.safetensors": save({k: v.contiguous() for k, v in weights.items()})}


def main(argv: list[str]) -> int:
    cmd, *args = argv or [""]
    try:
        if cmd == "slim":
            mb = float(args[args.index("--max-mb") + 1]) if "--max-mb" in args else 15.0
            print(slim(Path(args[0]), Path(args[1]), mb))
        elif cmd == "restore":
            print(restore(Path(args[0]), Path(args[1]), Path(args[2])))
        elif cmd == "ship":
            print(ship(Path(args[0]), Path(args[1])))
        elif cmd == "prune":
            print(prune(Path(args[0]), Path(args[1]), Path(args[2])))
        elif cmd == "widen":
            print(widen(Path(args[0]), Path(args[1]), Path(args[2])))
        elif cmd == "grow" and len(args) == 2:
            print(grow(Path(args[0]), Path(args[1])))
        elif cmd == "average" and len(args) >= 3:
            print(average(Path(args[0]), [Path(a) for a in args[1:]]))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ValueError as e:
        print(f"draft_transfer {cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
