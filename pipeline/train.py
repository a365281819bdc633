"""`train` step: the EAGLE-3 drafter, trained by speculators' own `train` CLI on the verified states.

Layout in runs/<run>/train/:
  data/           what speculators reads with --data-path: the prepared train rows followed by the
                  eval rows (a Hugging Face dataset; speculators' contiguous split with
                  --train-data-ratio puts exactly our eval rows in its validation split) and
                  hidden_states/hs_<j>.safetensors as links to the verified extraction files
                  (train.hidden_states = "stream": no links; the target computes them batch by batch)
  checkpoints/    speculators' --save-path: one folder per epoch; a rerun resumes from the newest
  untrained/      the same drafter, randomly initialised (speculators --dry-run): eval's floor
  checkpoint      link to the final epoch (what vLLM loads with method eagle3)
  metrics.jsonl   speculators' per-step train and per-epoch val metrics; curves.png plots them
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .config import REPO_ROOT, Config
from .extract import SPLITS, resolve_layer_ids
from .hidden_states import META, file_name, header, truncation
from .loops import mask_terminal_loops
from .manifest import StepError, hash_tree, require_manifest, require_patched_speculators


def speculators_args(cfg: Config, out: Path, aux_ids: list[int], vocab_dir: Path) -> list[str]:
    import torch

    args = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(cfg.model_path),
        "--data-path", str(out / "data"),
        "--save-path", str(out / "checkpoints"),
        "--target-layer-ids", *map(str, aux_ids),
        "--d2t-path", str(vocab_dir / "d2t.npy"),
        "--t2d-path", str(vocab_dir / "t2d.npy"),
        "--draft-vocab-size", str(cfg.vocab.draft_vocab_size),
        "--num-layers", str(cfg.train.num_layers),
        "--epochs", str(cfg.train.epochs),
        "--lr", str(cfg.train.lr),
        "--ttt-steps", str(cfg.train.ttt_steps),
        "--total-seq-len", str(cfg.train.total_seq_len),
        "--seed", str(cfg.run.seed),
        "--on-missing", "raise",
        "--log-dir", str(out / "logs"),
    ]
    if cfg.model.trust_remote_code:
        args.append("--trust-remote-code")
    if not torch.cuda.is_available():
        # FlexAttention has no CPU backward; the fused loss is a Triton kernel. float32: speculators autocasts to
        # its hidden-states dtype (bf16 by default), and a CPU without bf16 instructions (AVX2 only) runs bf16
        # matmuls ~90x slower than fp32 (NOTES "CPU dtype"); fp32 also gives every CPU host the same numbers.
        args += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
                 "--hidden-states-dtype", "float32"]
    return args + list(cfg.train.extra_args)


def loss_tokens(ds) -> int:
    """Tokens with loss-mask 1 in a prepared split, summed in Arrow (a Python sum over 9M tokens takes seconds)."""
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_flatten(ds.with_format("arrow")["loss_mask"])).as_py() or 0)


def build_data_dir(cfg: Config, data: Path, links: bool = True) -> tuple[int, int, dict]:
    """Train rows then eval rows, with hidden-state links numbered to match (none when `links` is false: the stream
    path). Returns (train, eval) sizes and the train rows' loss tokens: `train_loss_tokens` (after
    train.mask_loops), `loop_masked_tokens` (what it took out)."""
    from datasets import concatenate_datasets, load_from_disk

    parts = [load_from_disk(str(cfg.step_dir("prepare") / s)) for s in SPLITS]
    if cfg.train.max_samples:  # prepare's rows are in seeded random order: a prefix is a random subset
        parts[0] = parts[0].select(range(min(cfg.train.max_samples, len(parts[0]))))
    loss = {"train_loss_tokens": loss_tokens(parts[0])}
    if cfg.train.mask_loops:
        parts[0] = parts[0].map(lambda row: {"loss_mask": mask_terminal_loops(row["input_ids"], row["loss_mask"])[0]},
                                features=parts[0].features, desc="masking terminal loops", keep_in_memory=True)
        kept = loss_tokens(parts[0])
        loss.update(loop_masked_tokens=loss["train_loss_tokens"] - kept, train_loss_tokens=kept)
    hs = data / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    j = 0
    for split, ds in zip(SPLITS, parts if links else []):
        for i in range(len(ds)):
            link = hs / file_name(j)
            src = cfg.step_dir("extract") / split / file_name(i)
            if not src.exists():
                raise StepError(f"{src} is missing; rerun `make extract verify`")
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(src, hs))
            j += 1
    if not (data / "dataset_info.json").exists():
        ds = concatenate_datasets(parts)
        ds.set_format("torch")  # speculators compares tensors; plain lists fail in its collate
        ds.save_to_disk(str(data))
    return len(parts[0]), len(parts[1]), loss


def preflight(cfg: Config) -> None:
    """Before the step runner touches runs/<run>/train: a speculators without its patch series is refused here, so
    `train --force` in a wrong environment keeps the checkpoints it has."""
    require_patched_speculators()
    if cfg.train.init_from:  # a drafter that cannot start this run is refused before anything is redone
        check_init(cfg)


def stream_spec(cfg: Config) -> dict | None:
    """What the stream path computes with (None on the disk path): it is in train's fingerprint, as the
    extraction's manifest is on the disk path."""
    if cfg.train.hidden_states != "stream":
        return None
    require_manifest(cfg, "model")  # resolve_layer_ids reads the target's config.json: "run the model step" first
    ids, _, _ = resolve_layer_ids(cfg)
    return {"model_path": str(cfg.model_path), "layer_ids": ids, "dtype": cfg.model.dtype,
            "trust_remote_code": cfg.model.trust_remote_code}


def run(cfg: Config, out: Path) -> dict:
    stream = stream_spec(cfg)
    require_manifest(cfg, "prepare" if stream else "verify")
    patches = require_patched_speculators()
    vocab_dir = cfg.step_dir("vocab")
    configured, n, _ = resolve_layer_ids(cfg)
    meta = {"layer_ids": configured} if stream else json.loads((cfg.step_dir("extract") / META).read_text())
    if configured != meta["layer_ids"]:
        raise StepError(
            f"layer ids disagree: the extraction in {cfg.step_dir('extract')} captured {meta['layer_ids']} "
            f"but {cfg.source_path} now says {configured}; rerun `make extract verify` or restore extract.layer_ids"
        )
    ids = meta["layer_ids"]
    if ids[-1] != n:
        raise StepError(f"EAGLE-3 training needs the final pre-norm state (id {n}) as the last layer id; got {ids}")
    aux = ids[:-1]
    n_train, n_eval, loss_tokens = build_data_dir(cfg, out / "data", links=not stream)
    if stream:
        print(f"[train] hidden states streamed: the target ({cfg.model.dtype}) computes layers {ids} of each batch "
              f"on the training device; no extraction files are read")
    if cfg.train.mask_loops:
        print(f"[train] mask_loops: {loss_tokens['loop_masked_tokens']:,} loss tokens in terminal loops taken out of "
              f"the train rows, {loss_tokens['train_loss_tokens']:,} left")
    if n_eval == 0:
        raise StepError("the eval split is empty; raise data.max_conversations or data.eval_fraction")
    args = speculators_args(cfg, out, aux, vocab_dir)
    args += ["--train-data-ratio", str((n_train + 0.5) / (n_train + n_eval))]
    cold = list(args)  # the untrained floor stays a random draft of this shape, warm start or not
    init = write_init(cfg, vocab_dir, out / "init") if cfg.train.init_from else None
    if init:  # speculators refuses --num-layers beside --from-pretrained: the drafter's own shape (checked) stands
        i = args.index("--num-layers")
        args[i:i + 2] = ["--from-pretrained", str(out / "init")]
        print(f"[train] starting from {cfg.train.init_from} ({init['weights']} tensors kept; embedding and lm_head the "
              f"target's, vocabulary maps this run's)")
    (out / "train_command.txt").write_text(" ".join(["speculators", "train", *args]) + "\n"
                                           + (f"# hidden states streamed (--stream): {json.dumps(stream)}\n" if stream else ""))

    untrained = out / "untrained"
    if not (untrained / "model.safetensors").exists():
        dry = [*_replace(cold, "--save-path", str(untrained)), "--dry-run"]
        if "--hidden-states-dtype" in dry:  # the dry run saves in this dtype: bf16, as the trained checkpoints
            dry = _replace(dry, "--hidden-states-dtype", "bfloat16")
        _speculators(out, dry, "untrained", out / "untrained.jsonl", stream=stream)
    set_aside_incomplete_checkpoints(out / "checkpoints")
    _speculators(out, args, "train", out / "metrics.jsonl", cfg=cfg, stream=stream)

    final = last_epoch(out / "checkpoints")
    link = out / "checkpoint"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.relative_to(out))
    check = check_draft_checkpoint(final, aux, cfg.vocab.draft_vocab_size, vocab_dir)
    check_frozen_weights(final, cfg.model_path, vocab_dir)
    rows = read_metrics(out) or []
    plot_curves(rows, out / "curves.png")
    # None when the last epoch's validation row is missing (a resume past a stop during it), as ship's record of an
    # unfinished run says it
    last_val = final_val(rows, cfg.train.epochs)
    summary = {
        "checkpoint": str(final),
        "untrained_checkpoint": str(untrained),
        "epochs": cfg.train.epochs,
        "hidden_states": cfg.train.hidden_states,
        **({"precision": cfg.model.precision} if stream else {}),  # eval's precision check (extract's, on disk)
        "speculators_patches": patches,
        "train_samples": n_train,
        "val_samples": n_eval,
        **loss_tokens,
        "eagle_aux_hidden_state_layer_ids": check["aux_ids"],
        "final_val": last_val,
        "validated": last_val is not None,
        "train_tokens_per_s": train_throughput(rows),
        **({"init_from": {"path": cfg.train.init_from, **init}} if init else {}),
    }
    # the data folder's links to the hidden states count by where they point: extract's hash has their bytes
    return {"summary": summary, "outputs_hash": hash_tree(out, follow_links=False)}


def init_hashes(cfg: Config) -> dict[str, str]:
    """sha256 of each file of the drafter train.init_from names: in train's fingerprint, and the lineage a shipped
    continuation records (pipeline.ship)."""
    from .manifest import sha256_file

    return {f.name: sha256_file(f) for f in init_files(cfg)}


def drafter_files(src: Path) -> tuple[list[str], list[str]]:
    """The weight and config files of a drafter folder (a slim folder: config.json, slim.json and the files it
    lists; any other form: config.json and model.safetensors), and those of them missing. What names a drafter by
    its bytes: train's fingerprint of train.init_from, and pipeline.ship's record of the drafters in a mean."""
    if (src / "slim.json").exists():
        names = ["config.json", "slim.json", *json.loads((src / "slim.json").read_text())["files"]]
    else:
        names = ["config.json", "model.safetensors"]
    return names, [n for n in names if not (src / n).is_file()]


def init_files(cfg: Config) -> list[Path]:
    """The weight and config files of the drafter train.init_from names (what train's fingerprint hashes)."""
    src = cfg.path(cfg.train.init_from)
    names, missing = drafter_files(src)
    if missing:
        raise StepError(f"train.init_from = {cfg.train.init_from!r} in {cfg.source_path or 'the config'}: {src} lacks "
                        f"{', '.join(missing)}; point it at a drafter folder (a shipped drafter, a slim folder or a "
                        f"speculators checkpoint), or set it to \"\" to start from random weights")
    return [src / n for n in names]


def check_init(cfg: Config) -> dict:
    """train.init_from's config.json, once its files are there and its shape is this run's: EAGLE-3, the same aux
    layer ids (the configured ones; train checks them against the extraction's), decoder layers and hidden size."""
    src = cfg.path(cfg.train.init_from)
    init_files(cfg)
    conf = json.loads((src / "config.json").read_text())
    layer = conf.get("transformer_layer_config", {})
    require_manifest(cfg, "model")  # the target's config.json: "run the model step" first
    ids, _, hidden = resolve_layer_ids(cfg)
    wrong = [f"{what} {got} (this run: {want})" for what, got, want in (
        ("speculators_model_type", conf.get("speculators_model_type"), "eagle3"),
        ("eagle_aux_hidden_state_layer_ids", conf.get("eagle_aux_hidden_state_layer_ids"), ids[:-1]),
        ("num_hidden_layers", layer.get("num_hidden_layers"), cfg.train.num_layers),
        ("hidden_size", layer.get("hidden_size"), hidden)) if got != want]
    if wrong:
        raise StepError(f"train.init_from = {cfg.train.init_from!r} in {cfg.source_path or 'the config'}: "
                        f"{src / 'config.json'} has " + "; ".join(wrong) + ": it cannot start this run (set "
                        "train.num_layers or extract.layer_ids to match it, or start from random weights with "
                        "train.init_from = \"\")")
    return conf


def write_init(cfg: Config, vocab_dir: Path, out: Path) -> dict:
    """train.init_from as speculators' --from-pretrained reads it, in OUT: the drafter's decoder layers, fc and norms,
    with the target's embedding and this run's rows of the target's lm_head (what speculators gives a new draft, and
    never trains), float32. Every tensor must be in the folder: speculators 0.9's from_pretrained initialises a
    missing embedding or lm_head at random and says at most "MISSING" in its log (session 26). The drafter's shape
    is checked against this run's first."""
    from safetensors.torch import save_file

    from .draft_transfer import EMBED, _served_weights, target_input_embedding

    src = cfg.path(cfg.train.init_from)
    conf = check_init(cfg)
    # float32, as a draft speculators initialises itself: its optimizer updates these weights (a bf16 config makes
    # from_pretrained load bf16 parameters, which the CPU path's float32 states cannot even multiply)
    weights = {k: v.float() for k, v in _served_weights(src).items() if k not in ("lm_head.weight", "d2t", "t2d")}
    weights[EMBED] = target_input_embedding(cfg.model_path).float()
    weights["lm_head.weight"] = lm_head_rows(cfg.model_path, vocab_dir).float()
    source_vocab = conf.get("draft_vocab_size")
    conf["draft_vocab_size"] = cfg.vocab.draft_vocab_size  # this run's maps decide the lm_head's rows
    conf["dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return {"weights": len(weights) - 2, "source_draft_vocab_size": source_vocab}


def lm_head_rows(target: Path, vocab_dir: Path):
    """The target's output embedding at this run's draft vocabulary (t2d): a speculators draft's lm_head."""
    import numpy as np
    import torch

    from .draft_transfer import target_output_embedding

    head = target_output_embedding(target)
    return head[torch.from_numpy(np.load(vocab_dir / "t2d.npy")).bool()]


def check_frozen_weights(ckpt: Path, target: Path, vocab_dir: Path) -> None:
    """The draft's embedding and lm_head are the target's (its lm_head at the draft vocabulary's rows), frozen:
    speculators copies them in and never trains them. Anything else (a warm start whose embedding or lm_head was
    lost and initialised at random) drafts from other token vectors than vLLM gives it, and says nothing."""
    import torch
    from safetensors import safe_open

    from .draft_transfer import EMBED, target_input_embedding

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for key, want in ((EMBED, lambda: target_input_embedding(target)),
                          ("lm_head.weight", lambda: lm_head_rows(target, vocab_dir))):
            if key not in keys:
                continue  # a form without it: served with the target's
            got, ref = f.get_tensor(key), want()
            if got.shape != ref.shape or not torch.equal(got, ref.to(got.dtype)):
                raise StepError(f"{ckpt / 'model.safetensors'}: {key} is not the target's ({target}); speculators "
                                f"trained the draft on other token vectors than vLLM gives it")


def checkpoint_complete(d: Path) -> bool:
    """An epoch folder speculators can resume from: the config, the whole weights file (its safetensors header
    and every tensor's bytes present) and a readable optimizer archive. A kill while speculators writes an
    epoch leaves the folder without them, or with a file cut short."""
    import zipfile

    model, optim = d / "model.safetensors", d / "optimizer_state_dict.pt"
    if not ((d / "config.json").is_file() and model.is_file() and optim.is_file() and zipfile.is_zipfile(optim)):
        return False
    try:
        return truncation(model, header(model)) is None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def set_aside_incomplete_checkpoints(ckpts: Path) -> list[Path]:
    """speculators resumes from the highest-numbered epoch folder, complete or not (a kill mid-save leaves one
    without weights, and the rerun fails on it). Such a folder is renamed `incomplete-<epoch>-<n>` (speculators
    skips names that are not numbers), so the rerun resumes from the last complete epoch and nothing is deleted."""
    moved = []
    for _, d in epoch_dirs(ckpts):
        if checkpoint_complete(d):
            continue
        i = 0
        while (ckpts / f"incomplete-{d.name}-{i}").exists():
            i += 1
        target = ckpts / f"incomplete-{d.name}-{i}"
        d.rename(target)
        moved.append(target)
        print(f"[train] WARNING: epoch checkpoint {d} is incomplete (killed while being written?); set aside as "
              f"{target.name}, resuming from the last complete epoch")
    return moved


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _speculators(out: Path, args: list[str], name: str, metrics: Path, cfg: Config | None = None,
                 stream: dict | None = None) -> None:
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "pipeline.engines.speculators_train", "--metrics", str(metrics),
           *(["--stream", json.dumps(stream)] if stream else []), "--", *args]
    if cfg is not None:
        cmd = _torchrun_command(cfg, cmd)
    print(f"[train] {name}: speculators train (log: {log})")
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # tee: progress on the terminal, everything in the log
            f.write(line)
            if name == "train" and (line.startswith("Epoch ") or "Error" in line or "Traceback" in line):
                print(line.rstrip()[-160:], flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-25:])
        raise StepError(f"speculators train ({name}) failed (exit {rc}); log {log}, last lines:\n    {tail}")


def _torchrun_command(cfg: Config, cmd: list[str]) -> list[str]:
    """The training command under torchrun when train.nproc_per_node x train.nnodes > 1; else unchanged."""
    t = cfg.train
    if t.nproc_per_node == 1 and t.nnodes == 1:
        return cmd
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(t.nproc_per_node),
              "--nnodes", str(t.nnodes)]
    if t.rdzv_endpoint:
        launch += ["--rdzv-backend", t.rdzv_backend, "--rdzv-endpoint", t.rdzv_endpoint,
                   "--rdzv-id", t.rdzv_id or cfg.run.name]
    else:
        launch += ["--standalone"]
    assert cmd[1] == "-m"
    return [*launch, "-m", *cmd[2:]]


def epoch_dirs(ckpts: Path) -> list[tuple[int, Path]]:
    """speculators' epoch folders (numbered, not its descriptive symlinks), in epoch order."""
    if not ckpts.is_dir():
        return []
    return sorted((int(p.name), p) for p in ckpts.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit())


def last_epoch(ckpts: Path) -> Path:
    epochs = epoch_dirs(ckpts)
    if not epochs:
        raise StepError(f"speculators wrote no checkpoint under {ckpts}")
    return epochs[-1][1]


def check_draft_checkpoint(path: Path, aux_ids: list[int], draft_vocab: int, vocab_dir: Path | None = None) -> dict:
    """The exported draft carries the vocab maps (unless its vocabulary is the target's whole one) and the
    extraction's aux layer ids."""
    import numpy as np
    from safetensors import safe_open

    cfg_path, weights = path / "config.json", path / "model.safetensors"
    if not cfg_path.exists() or not weights.exists():
        raise StepError(f"draft checkpoint {path} is missing config.json or model.safetensors")
    conf = json.loads(cfg_path.read_text())
    got = conf.get("eagle_aux_hidden_state_layer_ids")
    if got != aux_ids:
        raise StepError(
            f"{cfg_path}: eagle_aux_hidden_state_layer_ids = {got}, but the hidden states were extracted at {aux_ids}; "
            f"vLLM would feed the draft other layers than it was trained on"
        )
    full = draft_vocab == conf.get("transformer_layer_config", {}).get("vocab_size")
    with safe_open(str(weights), "np") as f:
        keys = set(f.keys())
        if full and "d2t" not in keys:  # a draft over the whole target vocabulary needs no maps (speculators drops them)
            return {"aux_ids": got}
        if not {"d2t", "t2d"} <= keys:
            raise StepError(
                f"{weights} has no vocab maps (d2t/t2d); vLLM would map draft ids to the first {draft_vocab} target ids "
                f"and acceptance would collapse. Re-export the checkpoint with its vocab maps."
            )
        d2t = f.get_tensor("d2t")
        if len(d2t) != draft_vocab:
            raise StepError(f"{weights}: d2t has {len(d2t)} entries, draft vocab is {draft_vocab}")
        if vocab_dir is not None and not np.array_equal(d2t, np.load(vocab_dir / "d2t.npy")):
            raise StepError(f"{weights}: d2t differs from the vocab step's {vocab_dir / 'd2t.npy'}")
    return {"aux_ids": got}


def read_metrics(train_dir: Path) -> list[dict] | None:
    """TRAIN_DIR/metrics.jsonl's rows (speculators' records, mirrored by train); None when it is missing."""
    try:
        return [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return None


def val_rows(rows: list[dict]) -> dict[int, dict]:
    """speculators' validation rows in metrics.jsonl by their own epoch number, not by position: a train step
    resumed after a stop during an epoch's validation (its checkpoint saved first) appends the later epochs' rows
    with that epoch's missing, so the n-th row can be epoch n+1's."""
    return {r["epoch"]: r["val"] for r in rows if isinstance(r.get("val"), dict) and isinstance(r.get("epoch"), int)}


def val_summary(val: dict) -> dict:
    """One epoch's validation row of speculators' metrics.jsonl as train's summary records it."""
    return {k: round(v, 4) for k, v in val.items() if isinstance(v, (int, float))}


def final_val(rows: list[dict], epochs: int) -> dict | None:
    """The last scheduled epoch's validation (by its epoch number, as val_rows reads them), None when metrics.jsonl
    has none for it: the last row by position would be an earlier epoch's when that epoch's row is missing."""
    vals = val_rows(rows)
    return val_summary(vals[epochs - 1]) if epochs - 1 in vals else None


def train_throughput(rows: list[dict]) -> float | None:
    """Tokens/s of metrics.jsonl's training steps: the mean of speculators' per-step profile after the first step."""
    vals = [r.get("profile", {}).get("tokens_per_s") for r in rows if "train" in r]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return round(sum(vals[1:]) / len(vals[1:]), 1) if len(vals) > 1 else None


def plot_curves(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "train" in r]
    val = [r for r in rows if "val" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for src, style, label in ((train, "-", "train"), (val, "o--", "val")):
        if not src:
            continue
        x = [r.get("global_step") or r.get("step") or 0 for r in src]  # val rows carry the step they ran at
        metrics = src[0][label]
        for key in sorted(k for k in metrics if k.startswith("loss_")):
            axes[0].plot(x, [r[label].get(key) for r in src], style, label=f"{label} {key}")
        for key in sorted(k for k in metrics if k.startswith("full_acc_")):
            axes[1].plot(x, [r[label].get(key) for r in src], style, label=f"{label} {key}")
    axes[0].set_title("loss per TTT position")
    axes[1].set_title("accuracy per TTT position")
    axes[0].set_xlabel("optimizer step (val: end of each epoch)")
    axes[1].set_xlabel("optimizer step (val: end of each epoch)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
