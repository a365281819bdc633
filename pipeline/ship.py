"""Ship a drafter: its serving form and a results file in one folder, replacing what is there only when the new
drafter is better.

    python -m pipeline.ship --config configs/smollm2-quality.toml --run RUN_DIR DRAFT [--widen] [--out DIR] [--max-mb 25] [--force]
                            [--epoch N] [--average-with SHIPPED_DIR ...] [--average-epoch N DIR ...]

DRAFT is a speculators checkpoint or a slim folder (`pipeline.draft_transfer slim`); RUN_DIR the run that trained
it (its step manifests say how: data, vocabulary, training). The drafter is written in the form vLLM serves as
it is (`draft_transfer ship`: no frozen embedding; with --widen, `draft_transfer widen`: no lm_head either, the
draft proposing over the target's whole vocabulary through the target's lm_head), then evaluated in that form by this repository's evaluator
(the config's [eval]: vLLM counters, greedy) on MT-bench first turns and on the held-out first turns of the
config's data, so the results file describes exactly the bytes beside it. The folder (default
data/drafters/<target folder name, lower case>) is replaced only when the new MT-bench acceptance length is
higher than the one in its results.json (--force replaces it anyway, e.g. after the eval protocol changed);
otherwise the new drafter and its results stay in <out>.rejected/ and the command exits 3.

--average-with SHIPPED_DIR (repeatable) ships the uniform weight average of DRAFT and those drafters
(`draft_transfer average`; the start and the end of a continuation averaged have served higher than either). Each
must be a shipped drafter, its results.json describing its bytes (usually data/drafters/<name>, the folder about to
be replaced: committed, so a commit holds its bytes), so results.json's `average` names every drafter in the mean:
its path, its files' sha256, a commit holding them and its own results (recipe, MT-bench AL); `recipe` stays
DRAFT's run. --average-epoch N DIR (repeatable) adds an earlier checkpoint of the same run: DIR holds, by the
caller's word, its checkpoint after epoch N (0-based; the run's metrics must have logged that epoch, before DRAFT's
last), recorded by path and sha256. The mean is taken in the order shipped drafters, earlier epochs, DRAFT (the
start, the middle, the end). Drafters of one form only: widened ones (no lm_head) average with widened ones.

--epoch N: DRAFT is, by the caller's word, the run's checkpoint after epoch N (0-based), not its end: an earlier one
of a finished run (results.json then says "N+1 epochs of an M-epoch schedule", its validation that epoch's), or one
of a run whose train step left no manifest (`unfinished_train`).

results.json: recipe, data sources and counts, epochs, MT-bench and held-out acceptance (AL, per position,
outputs identical to the greedy target), file sizes and hashes, the commit it was trained at and shipped from.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from .config import REPO_ROOT, Config, load_config
from .manifest import StepError, _rel, git, git_commit, read_manifest, sha256_file, write_json_atomic
from .model import require_target

RESULTS = "results.json"
SET_KEYS = ("acceptance_length", "acceptance_rate", "per_position_acceptance", "outputs_identical_to_baseline",
            "all_outputs_identical", "tokens_per_s", "speedup")


def default_out(cfg: Config) -> Path:
    return REPO_ROOT / "data" / "drafters" / Path(cfg.model.path).name.lower()


def unfinished_train(run: Path, cfg: Config, epoch: int) -> dict:
    """A stand-in for the train manifest of a run whose training did not finish (the device time ran out
    mid-schedule), or whose manifest never came back from the device (session 33: the last checkpoint was sent
    before the train step wrote it): the draft is its checkpoint after epoch `epoch` (0-based, the checkpoint
    folder's name). What speculators logged (its arguments, the per-step profile, the validation rows) says how it
    was trained; the train section is the shipping config's, so --config/--set must name the run's own train
    settings."""
    from .train import final_val, init_hashes, read_metrics, train_throughput, val_rows  # train's own readers of the same rows

    path, rows = run / "train" / "metrics.jsonl", read_metrics(run / "train")
    if rows is None:
        raise StepError(f"{run}/train: neither manifest.json nor metrics.jsonl; --run must be the run that trained the draft")
    args, vals = rows[0], val_rows(rows)
    # speculators saves an epoch's checkpoint before that epoch's validation: a run stopped during it (session 30's
    # deadline) has the checkpoint and the epoch's step rows, but no val row for it
    stepped = any(r.get("epoch") == epoch and "train" in r for r in rows)
    if not (epoch >= 0 and (epoch in vals or stepped)):
        raise StepError(f"{path}: epochs validated {sorted(vals)} and no steps logged for epoch {epoch}, so there is "
                        f"no checkpoint after epoch {epoch} (0-based) of it")
    scheduled = args.get("trainer", {}).get("epochs")
    draft = args.get("draft", {})
    # with --from-pretrained (train.init_from) the layer count is the init drafter's (train checks it against
    # train.num_layers) and the logged num_layers is speculators' unused default
    logged = {"train.epochs": scheduled, "train.num_layers": None if draft.get("from_pretrained") else draft.get("num_layers"),
              "train.lr": args.get("optimizer", {}).get("lr"), "train.ttt_steps": args.get("loss", {}).get("ttt_steps"),
              "train.total_seq_len": args.get("data", {}).get("total_seq_len")}
    differ = [f"{k} (run: {v!r}, config: {getattr(cfg.train, k[6:])!r})" for k, v in logged.items()
              if v is not None and v != getattr(cfg.train, k[6:])]
    if differ:
        raise StepError(f"{path}: the run was trained with other settings than {_rel(cfg.source_path)} says: "
                        f"{', '.join(differ)}; --set them, so results.json records the run's own")
    if epoch + 1 > (scheduled or 0):
        raise StepError(f"{path}: epoch {epoch} (0-based) is past the schedule's last ({scheduled} epochs)")
    # the drafter it started from, as train's fingerprint hashed it (the lineage started_from records); as the
    # shipping config names it, so --set train.init_from must name the run's own (checked against train's .fingerprint
    # nowhere: the run left no manifest)
    inputs = {"init_from": init_hashes(cfg)} if cfg.train.init_from else {}
    return {"config_sections": {"train": dataclasses.asdict(cfg.train)}, "inputs": inputs,
            "summary": {"epochs": epoch + 1, "epochs_scheduled": scheduled,
                        "finished": epoch + 1 == scheduled and epoch in vals,
                        "eagle_aux_hidden_state_layer_ids": draft.get("target_layer_ids"),
                        "final_val": final_val(rows, epoch + 1),  # as train's summary of an epoch + 1 schedule
                        "validated": epoch in vals, "train_tokens_per_s": train_throughput(rows)}}


def earlier_checkpoint(train: dict, run: Path, epoch: int) -> dict:
    """The train manifest of a finished run, made to describe its checkpoint after an earlier epoch (0-based; session
    43: the mean of the start and epoch 2 of 3 led MT-bench): the settings, inputs and stack stay the run's; the epoch
    count and the validation are that checkpoint's, from the run's metrics.jsonl; the run's seconds are dropped (they
    are the whole schedule's)."""
    from .train import read_metrics, val_rows, val_summary

    last = train["summary"].get("epochs") or 0
    if epoch == last - 1:
        raise StepError(f"{run}/train finished (it has a manifest) and epoch {epoch} is its last checkpoint: ship it "
                        f"without --epoch")
    if not 0 <= epoch < last:
        raise StepError(f"{run}/train finished {last} epochs: there is no checkpoint after epoch {epoch} (0-based) of it")
    vals = val_rows(read_metrics(run / "train") or [])
    if epoch not in vals:
        raise StepError(f"{run}/train/metrics.jsonl: no validation row for epoch {epoch}; --run must be the run that "
                        f"trained the draft, with its metrics.jsonl")
    return {**train, "seconds": None, "summary": {**train["summary"], "epochs": epoch + 1, "epochs_scheduled": last,
                                                  "finished": False, "validated": True,
                                                  "final_val": val_summary(vals[epoch])}}


def recipe(run: Path, cfg: Config | None = None, epoch: int | None = None, shipped: list[Path] = ()) -> dict:
    """How the drafter was made, from its run's step manifests (with `epoch`, the checkpoint after that epoch:
    `earlier_checkpoint` of a finished run, `unfinished_train` of one whose train step did not finish); `shipped`:
    where else to find the drafter it started from (`started_from`)."""
    def manifest(step: str) -> dict:
        m = read_manifest(run / step)
        if not m:
            raise StepError(f"{run / step}: no manifest.json; --run must be the run folder that trained the draft")
        return m

    prep, vocab = manifest("prepare"), manifest("vocab")
    if epoch is None:
        train = manifest("train")
    elif finished := read_manifest(run / "train"):
        train = earlier_checkpoint(finished, run, epoch)
    else:
        train = unfinished_train(run, cfg, epoch)
    ps, ts = prep["summary"], train["summary"]
    data = prep["config_sections"]["data"]
    return {
        "config_file": train.get("config_file"),
        "run": run.name,
        "data": {
            "sources": [{k: s.get(k) for k in ("tag", "path", "sha256", "weight", "selected")} for s in ps["sources"]]
                       if ps.get("sources") else
                       [{"name": ps.get("source") or data.get("path") or data["source"],
                         "package": prep.get("stack", {}).get("SHAREGPT_PACKAGE"),  # the file is read from, or derived from, it
                         "conversations": ps.get("selected"), "weight": 1.0}],
            "regenerate": data.get("regenerate"), "max_new_tokens": data.get("max_new_tokens"),
            "regenerated_answers": ps.get("regenerated_turns"), "train_samples": ps.get("train_samples"),
            "eval_samples": ps.get("eval_samples"), "tokens": ps.get("tokens"),
            "assistant_tokens": ps.get("assistant_tokens"), "mtbench_near_duplicates_removed":
                ps.get("mtbench_near_duplicates_removed"),
        },
        "vocab": {k: vocab["summary"].get(k) for k in ("draft_vocab_size", "target_vocab_size", "coverage_train",
                                                        "coverage_eval", "d2t_sha256")},
        "train": {**train["config_sections"]["train"], "epochs": ts.get("epochs"),
                  **({k: ts[k] for k in ("epochs_scheduled", "finished", "validated")} if "finished" in ts else {}),
                  "eagle_aux_hidden_state_layer_ids": ts.get("eagle_aux_hidden_state_layer_ids"),
                  "final_val": ts.get("final_val"), "tokens_per_s": ts.get("train_tokens_per_s"),
                  "seconds": train.get("seconds"), "gpus": [g["name"] for g in (train.get("host") or {}).get("gpus", [])],
                  "packages": train.get("packages"), "patch_series_sha256": train.get("patch_series_sha256"),
                  "git": train.get("git"),
                  **({"init_from": started_from(train, shipped)} if train["config_sections"]["train"].get("init_from") else {})},
    }


def started_from(train: dict, also: list[Path] = ()) -> dict:
    """The drafter a warm-started run (train.init_from) continued, by its files' sha256 as the run hashed them, and,
    where that drafter is the one shipped at that path now (the usual case: a continuation of the shipped drafter,
    which this ship then replaces), its results.json: where it came from (`shipped_from`, a commit that has its
    bytes), its MT-bench AL and its own recipe, so the chain of runs behind a continued drafter stays on record.
    `also`: shipped folders to look in when the path holds no results of those bytes (a run on the device that
    started from a copy of a drafter shipped since, session 39). A start that is a shipped drafter grown by a layer
    (`draft_transfer grow`) is that drafter's record, with `grown` saying so (`grown_record`)."""
    path = train["config_sections"]["train"]["init_from"]
    files = (train.get("inputs") or {}).get("init_from") or {}
    made = {"path": path, "files_sha256": files, **(train.get("summary", {}).get("init_from") or {})}
    for where in ((REPO_ROOT / path).resolve(), *also):  # a relative path is the repository's, as train reads it
        found = shipped_record(where, files) or grown_record(where, files)
        if found:
            return {**made, **({"shipped_at": found["path"]} if found["path"] != path else {}),
                    **({"grown": found["grown"]} if "grown" in found else {}),
                    "committed_in": found["committed_in"], "results": found["results"]}
    return {**made, "results": None}


def grown_record(folder: Path, files: dict[str, str]) -> dict | None:
    """FOLDER's shipped record (`shipped_record`, its own files as its results.json says) when FILES (sha256 of
    config.json and model.safetensors) are the bytes `draft_transfer.grown` makes of it, grown again here in memory
    to compare (the same bytes under the same torch and safetensors); None otherwise."""
    import hashlib

    from .draft_transfer import grown

    record = shipped_record(folder) if set(files or ()) == {"config.json", "model.safetensors"} else None
    if not record:
        return None
    try:
        made = grown(folder.resolve())
    except (ValueError, KeyError):  # not a drafter grow can grow: no lineage to find this way
        return None
    if {f: hashlib.sha256(made[f]).hexdigest() for f in files} != files:
        return None
    layers = json.loads(made["config.json"])["transformer_layer_config"]["num_hidden_layers"]
    return {**record, "grown": f"python -m pipeline.draft_transfer grow {record['path']} <out>: {layers - 1} "
                               f"decoder layers + 1 whose output projections start at zero"}


def shipped_record(folder: Path, files: dict[str, str] | None = None) -> dict | None:
    """A shipped drafter's folder as results.json records it: its path, a commit holding its bytes, and its results
    (where it came from, MT-bench AL, its own recipe). None when the folder has no results.json or holds other bytes
    than `files` (sha256 by name; default: the folder's own files, checked against what its results.json says)."""
    where = folder.resolve()
    results = where / RESULTS
    try:
        earlier = json.loads(results.read_text())
    except (OSError, ValueError):
        return None
    said = {f: e.get("sha256") for f, e in earlier.get("files", {}).items()}
    if files is None:  # every file results.json lists, as it is now (a missing one: not these bytes)
        files = {f: sha256_file(where / f) if (where / f).is_file() else None for f in said}
    if not files or {f: h for f, h in said.items() if f in files} != files:
        return None  # that folder holds other bytes now than those asked for (or than its results.json says)
    folder = where.relative_to(REPO_ROOT) if where.is_relative_to(REPO_ROOT) else None
    return {"path": folder.as_posix() if folder else str(where), "files_sha256": files,
            "committed_in": commit_holding(folder, list(files)) if folder else None, "results": one_level({
                "sha256": sha256_file(results), "shipped": earlier.get("shipped"),
                "shipped_from": earlier.get("shipped_from"),
                "mtbench_acceptance_length": (earlier.get("eval") or {}).get("mtbench", {}).get("acceptance_length"),
                "epochs": earlier.get("epochs"), "recipe": earlier.get("recipe"),
                **({"average": earlier["average"]} if earlier.get("average") else {})})}


LINK = ("sha256", "shipped", "shipped_from", "mtbench_acceptance_length", "epochs")


def one_level(record: dict) -> dict:
    """An earlier drafter's results as `shipped_record` embeds them, its own recipe and mean kept whole, but the
    drafters those name in turn (its recipe's `init_from`, the members of its mean) kept as links: their files'
    sha256, the commit holding them, and their results.json's sha256, date, commit, MT-bench AL and epochs (`git
    show <committed_in>:<path>/results.json` has the rest). Embedded whole, the chain doubled with every
    continuation, the start appearing both as `init_from` and in the mean: 1.6 MB to 3.6 MB in session 43."""
    def link(ref):
        r = ref.get("results") if isinstance(ref, dict) else None
        return {**ref, "results": {k: r.get(k) for k in LINK}} if isinstance(r, dict) else ref

    record = copy.deepcopy(record)
    train = (record.get("recipe") or {}).get("train") or {}
    if train.get("init_from"):
        train["init_from"] = link(train["init_from"])
    if isinstance(record.get("average"), dict) and record["average"].get("of"):
        record["average"]["of"] = [link(o) for o in record["average"]["of"]]
    return record


def commit_holding(folder: Path, names: list[str]) -> str | None:
    """The last commit that touched `folder`, if it holds exactly the bytes of `names` there now (so `git checkout
    <it> -- <folder>` brings them back); None otherwise (uncommitted bytes, no git, not a checkout)."""
    commit = git("log", "-1", "--format=%H", "--", str(folder))
    if not commit:
        return None
    for name in names:
        rel = (folder / name).as_posix()
        blob = git("hash-object", rel)
        if blob is None or git("rev-parse", f"{commit}:{rel}") != blob:
            return None
    return commit


# What decides which conversations prepare holds out (ids are hashed with the seed; a mix prefixes its ids)
SPLIT_KEYS = (("run", "seed", 0), ("data", "eval_fraction", None), ("data", "max_conversations", None),
              ("data", "sources", []), ("data", "weights", []))


def check_heldout_split(cfg: Config, run: Path) -> None:
    """The held-out prompts are rebuilt from the config: refuse when it would split the conversations other than
    the run that trained the draft did (the 'held-out' figure would be measured on trained-on prompts). data.path
    may differ (a file derived from the same conversations keeps their ids); it is recorded in results.json."""
    made = read_manifest(run / "prepare")["config_sections"]
    differ = [f"{s}.{k} (run: {made.get(s, {}).get(k, d)!r}, config: {getattr(getattr(cfg, s), k)!r})"
              for s, k, d in SPLIT_KEYS if made.get(s, {}).get(k, d) != getattr(getattr(cfg, s), k)]
    if differ:
        raise StepError(f"{_rel(cfg.source_path)} splits the data other than {run} did: {', '.join(differ)}; give "
                        f"--config the run's settings (or --set them) so the held-out prompts are the ones it held out")


def serving_form(draft: Path, out: Path, cfg: Config) -> None:
    """draft_transfer's ship form; the verifier named by the repository-relative target path, not this machine's."""
    from .draft_transfer import ship

    ship(draft, out)
    c = json.loads((out / "config.json").read_text())
    c.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = cfg.model.path
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")


def evaluate(cfg: Config, folder: Path, work: Path) -> dict:
    """MT-bench and held-out acceptance of the drafter in `folder`, by the config's evaluator. With several
    data.sources also the held-out prompts of each source alone ("heldout_by_source": e.g. ShareGPT's own held-out
    conversations, which the mix's held-out set blends with the other sources')."""
    from .evaluate import evaluate_drafts
    from .prepare import selected_conversations

    def one(prompts: str, source: str = "") -> dict:
        c = copy.deepcopy(cfg)
        c.eval.prompts, c.eval.heldout_source = prompts, source
        d = work / f"eval-{prompts}{'-' + source if source else ''}"
        d.mkdir(parents=True, exist_ok=True)
        r = evaluate_drafts(c, {"drafter": folder}, d)
        m = r["drafters"]["drafter"]
        return {"prompts": r["prompts"], "engine": r["engine"], "max_tokens": r["max_tokens"],
                "num_speculative_tokens": r["num_speculative_tokens"], "dtype": r["dtype"],
                "baseline_tokens_per_s": r["baseline_tokens_per_s"], **{k: m[k] for k in SET_KEYS}}

    # the sources with held-out conversations (prepare's per-source summary; one the MT-bench filter or
    # de-duplication emptied has none), known before the long evaluations start
    held = ([s["tag"] for s in selected_conversations(cfg)[1].sources if s["selected_eval"]]
            if len(cfg.data.sources) > 1 else [])
    results = {p: one(p) for p in ("mtbench", "heldout")}
    if held:
        results["heldout_by_source"] = {t: one("heldout", t) for t in held}
    return results


def folder_hashes(draft: Path) -> dict[str, str]:
    """sha256 of a drafter's files, as train hashes train.init_from (so a later run's lineage matches them)."""
    from .train import drafter_files

    names, missing = drafter_files(draft)
    if missing:
        raise StepError(f"{draft} lacks {', '.join(missing)}: not a drafter folder (a slim folder, a checkpoint or a "
                        f"shipped drafter)")
    return {n: sha256_file(draft / n) for n in names}


def averaged(draft: Path, others: list[Path], run: Path | None = None, epochs: list[tuple[int, Path]] = (),
             last: int | None = None, out: Path | None = None) -> dict:
    """What an averaged drafter is the mean of (results.json's `average`), checked before anything is written: DRAFT
    by its files and its run's recipe (results.json's own), each shipped one by its shipped record, each earlier
    checkpoint of the run (`epochs`: (0-based epoch, folder)) by its files, after the run's metrics show that epoch
    trained and before DRAFT's (`last`: DRAFT's epoch count). A shipped one that this ship may replace or set aside
    (`out`, `out`.rejected) must be committed: otherwise its bytes would be gone and the record name nothing."""
    logged = set()
    if epochs:
        from .train import read_metrics

        rows = read_metrics(run / "train")
        if rows is None:
            raise StepError(f"{run / 'train' / 'metrics.jsonl'}: missing; --average-epoch takes checkpoints of the run --run names")
        logged = {r.get("epoch") for r in rows if "train" in r}
    earlier = []
    for n, folder in epochs:
        if n not in logged or (last is not None and n >= last - 1):
            raise StepError(f"{folder}: --average-epoch {n} is not an earlier checkpoint of {run} (epochs with steps "
                            f"in its metrics: {sorted(e for e in logged if e is not None)}; the draft ends epoch "
                            f"{(last or 0) - 1}, 0-based)")
        earlier.append({"path": _rel(folder), "files_sha256": folder_hashes(folder), "epoch": n,
                        "results": f"this results.json's recipe, its checkpoint after epoch {n} (0-based: "
                                   f"{n + 1} of {last or '?'} epochs)"})
    shipped = []
    for folder in others:
        found = shipped_record(folder)
        if found is None:
            raise StepError(f"{folder}: no results.json that describes the bytes there; --average-with takes a "
                            f"shipped drafter (data/drafters/<name>, or a ship's .rejected folder), so the average "
                            f"can name what it is made of")
        if out is not None and found["committed_in"] is None and \
                folder.resolve() in (out.resolve(), out.with_name(out.name + ".rejected").resolve()):
            raise StepError(f"{folder}: its bytes are in no commit, and this ship replaces or sets aside that folder; "
                            f"commit it first, or copy it outside {out.parent} and average the copy")
        shipped.append(found)
    return {"of": [*shipped, *earlier, {"path": _rel(draft), "files_sha256": folder_hashes(draft),
                                        "results": "this results.json's recipe"}],
            "how": "uniform mean of the served weights, in float32, summed in this order, saved in their own dtype "
                   "(python -m pipeline.draft_transfer average); the vocabulary maps equal in all"}


def ship_drafter(cfg: Config, draft: Path, run: Path, out: Path, max_mb: float = 25.0, force: bool = False,
                 command: str = "", widen: bool = False, epoch: int | None = None,
                 average_with: list[Path] = (), average_epochs: list[tuple[int, Path]] = ()) -> int:
    require_target(cfg)
    made = recipe(run, cfg, epoch, [out])
    check_heldout_split(cfg, run)
    mean = (averaged(draft, list(average_with), run, list(average_epochs), made["train"]["epochs"], out)
            if average_with or average_epochs else None)  # before `out` may be replaced
    staged = out.with_name(out.name + ".new")
    shutil.rmtree(staged, ignore_errors=True)
    serving_form(draft, staged, cfg)
    if mean:
        from .draft_transfer import average

        try:  # the order `of` records; config.json stays the draft's, as serving_form wrote it
            average(staged, [*average_with, *(f for _, f in average_epochs), staged], config_from=staged)
        except Exception as e:  # nothing half-made is left beside the shipped drafter
            shutil.rmtree(staged, ignore_errors=True)
            if not isinstance(e, ValueError):
                raise
            raise StepError(f"{draft} cannot be averaged with {[str(f) for f in average_with]} "
                            f"{[str(f) for _, f in average_epochs]}: {e} (a widened drafter has no lm_head: average "
                            f"widened ones only with widened ones)") from None
    if widen:
        from .draft_transfer import widen as widen_vocab

        try:
            widen_vocab(staged, cfg.model_path, staged, name=str(draft))
        except ValueError as e:
            shutil.rmtree(staged)
            raise StepError(str(e)) from None
    size = (staged / "model.safetensors").stat().st_size
    if size > max_mb * 1e6:
        shutil.rmtree(staged)
        raise StepError(f"{draft}: {size / 1e6:.1f} MB in serving form, over the {max_mb:g}-MB limit for a shipped "
                        f"drafter (--widen drops the lm_head where it is the target's; a smaller vocab.draft_vocab_size shrinks it)")
    work = REPO_ROOT / ".cache" / "ship" / out.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    evals = evaluate(cfg, staged, work)
    sets = {**{s: e for s, e in evals.items() if s != "heldout_by_source"},
            **{f"heldout:{t}": e for t, e in evals.get("heldout_by_source", {}).items()}}
    bad = [s for s, e in sets.items() if not e["all_outputs_identical"]]
    if bad:
        raise StepError(f"{draft}: speculative outputs differ from the greedy target on {bad} ({work}); not shipped")
    results = {
        "drafter": out.name, "shipped": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": {"path": cfg.model.path, "source": cfg.model.source},
        "files": {f: {"bytes": (staged / f).stat().st_size, "sha256": sha256_file(staged / f)}
                  for f in ("config.json", "model.safetensors")},
        "recipe": made, "epochs": made["train"]["epochs"], **({"average": mean} if mean else {}),
        "served_vocab": ({"draft_vocab_size": json.loads((staged / "config.json").read_text())["draft_vocab_size"],
                          "lm_head": "the target's (not in the file: vLLM shares it)",
                          "how": "pipeline.draft_transfer widen: trained with the recipe's vocab, served over all "
                                 "target tokens"} if widen else None),
        "eval": evals, "eval_config": _rel(cfg.source_path),
        "shipped_from": git_commit(),
        "reproduce": {
            "evaluate": "make model eval CONFIG=<a config whose eval.draft names this folder, e.g. "
                        "configs/smollm2-shipped.toml>; held-out: add ARGS=\"--set eval.prompts=heldout\"; a mix's held-out prompts "
                        "also need its files as data.sources (recipe.data.sources), and --set "
                        "eval.heldout_source=<tag> picks one source's (the config's comments have the commands)",
            "ship": command,
        },
    }
    write_json_atomic(staged / RESULTS, results)
    if not install(staged, out, force):
        return 3
    print(f"[ship] {out}: {size / 1e6:.1f} MB, MT-bench AL {evals['mtbench']['acceptance_length']}, held-out AL "
          f"{evals['heldout']['acceptance_length']}, outputs identical {evals['mtbench']['outputs_identical_to_baseline']}"
          f" / {evals['heldout']['outputs_identical_to_baseline']}")
    for t, e in evals.get("heldout_by_source", {}).items():
        print(f"[ship]   held-out {t} alone: AL {e['acceptance_length']}, outputs identical "
              f"{e['outputs_identical_to_baseline']}")
    return 0


def install(staged: Path, out: Path, force: bool = False) -> bool:
    """Put the staged folder (complete, with its results.json) in place of `out` if its MT-bench AL is higher than
    the one shipped there (or `force`); else move it to <out>.rejected and keep `out`. True when installed."""
    backup = out.with_name(out.name + ".old")
    if backup.exists() and not out.exists():  # a swap cut short by a crash: the shipped drafter is the backup
        backup.rename(out)
    al = lambda d: json.loads((d / RESULTS).read_text())["eval"]["mtbench"]["acceptance_length"]  # noqa: E731
    new_al, old_al = al(staged), al(out) if (out / RESULTS).exists() else None
    if old_al is not None and new_al <= old_al and not force:
        rejected = out.with_name(out.name + ".rejected")
        shutil.rmtree(rejected, ignore_errors=True)
        staged.rename(rejected)
        print(f"[ship] kept {out}: MT-bench AL {old_al} there, {new_al} for the new one (left in {rejected}; "
              f"--force replaces)")
        return False
    if out.exists():  # swap: the old folder goes only once the new one is complete and in place
        shutil.rmtree(backup, ignore_errors=True)
        out.rename(backup)
        staged.rename(out)
        shutil.rmtree(backup)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged.rename(out)
    print(f"[ship] installed {out} (MT-bench AL {new_al}; before: {old_al})")
    return True


def main(argv: list[str] | None = None) -> int:
    from .__main__ import parse_set
    from .env import setup_env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe's config (its [model], [data] and [eval] are used)")
    ap.add_argument("--run", required=True, type=Path, help="the run folder that trained the draft (its manifests)")
    ap.add_argument("--out", type=Path, help="default: data/drafters/<target>")
    ap.add_argument("--max-mb", type=float, default=25.0)
    ap.add_argument("--force", action="store_true", help="replace the shipped drafter even if not better")
    ap.add_argument("--widen", action="store_true", help="serve over the target's whole vocabulary, without an "
                    "lm_head (draft_transfer widen)")
    ap.add_argument("--epoch", type=int, help="the draft is the checkpoint after this epoch (0-based) of the run: "
                    "an earlier one of a finished run, or any of a run with no train manifest (its training did not "
                    "finish, or the manifest never came back from the device); read from its metrics.jsonl")
    ap.add_argument("--average-with", action="append", default=[], type=Path, metavar="SHIPPED_DIR",
                    help="ship the weight average of the draft and this shipped drafter (repeatable)")
    ap.add_argument("--average-epoch", action="append", default=[], nargs=2, metavar=("N", "DIR"),
                    help="also average in the run's checkpoint after epoch N (0-based), in DIR (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    ap.add_argument("draft", type=Path, help="checkpoint or slim folder")
    a = ap.parse_args(argv)
    if any(not n.isdigit() for n, _ in a.average_epoch):
        ap.error(f"--average-epoch takes N DIR, N a 0-based epoch number: got {[n for n, _ in a.average_epoch]}")
    setup_env()
    cfg = load_config(a.config, parse_set(a.set))
    try:
        command = shlex.join(["python", "-m", "pipeline.ship", *(sys.argv[1:] if argv is None else argv)])
        return ship_drafter(cfg, a.draft, a.run, a.out or default_out(cfg), a.max_mb, a.force, command, a.widen,
                            a.epoch, a.average_with, [(int(n), Path(d)) for n, d in a.average_epoch])
    except StepError as e:
        print(f"[ship] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
