"""Scale and reproducibility (issue 6): plan, disk refusal, sharded extraction + coverage checks, compare,
determinism settings in manifests. Cheap: the extraction engine is replaced by a fake that writes correctly
shaped files (pipeline.extract.extract_samples is the one engine entry point); the real-vLLM shard run is in
test_data_pipeline.py."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import extract as extract_mod
from pipeline import plan as plan_mod
from pipeline.config import load_config
from pipeline.hidden_states import file_name
from pipeline.manifest import StepError, read_manifest, write_json_atomic
from pipeline.steps import run
from pipeline.verify import coverage_problems, structural_problems
from tests.conftest import REPO, write_config

KIMI = json.loads((REPO / "configs" / "targets" / "kimi-k2.5.json").read_text())
TINY = {"hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 16, "vocab_size": 50, "head_dim": 4}
SPLIT_SIZES = {"train": 5, "eval": 2}


# ---------------------------------------------------------------- a fake run (no engine, no weights)
@pytest.fixture
def fake_run(tmp_path_factory, monkeypatch):
    root = REPO / ".cache" / "test-scale"
    shutil.rmtree(root, ignore_errors=True)
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(TINY))
    cfg = load_config(write_config(root / "fake.toml", root / "runs", "fake",
                                   model={"source": "path", "path": str(model)},
                                   extract={"layer_ids": [1, 2, 4]}))
    (cfg.step_dir("model")).mkdir(parents=True)
    write_json_atomic(cfg.step_dir("model") / "manifest.json", {"status": "complete", "outputs_hash": "m"})
    from datasets import Dataset

    tokens = 0
    for split, n in SPLIT_SIZES.items():
        rows = [[(7 * i + j) % 50 for j in range(3 + i)] for i in range(n)]
        tokens += sum(map(len, rows))
        Dataset.from_dict({"input_ids": rows}).save_to_disk(str(cfg.step_dir("prepare") / split))
    write_json_atomic(cfg.step_dir("prepare") / "manifest.json", {
        "status": "complete", "outputs_hash": "p",
        "summary": {"train_samples": SPLIT_SIZES["train"], "eval_samples": SPLIT_SIZES["eval"], "tokens": tokens}})
    calls = []

    def fake_extract(cfg, todo, out, layer_ids, hidden, staging):
        calls.append([(s, i) for s, i, _ in todo])
        for split, i, ids in todo:
            g = torch.Generator().manual_seed(hash((split, i)) % 2**31)
            save_file({"hidden_states": torch.randn(len(ids), len(layer_ids), hidden, generator=g).to(getattr(torch, cfg.model.dtype)),
                       "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(out / split / file_name(i)))
        return {"tokens_extracted": sum(len(x[2]) for x in todo), "extract_s": 0.5, "server_start_s": 0.0}

    monkeypatch.setattr(extract_mod, "extract_samples", fake_extract)
    cfg.fake_calls = calls
    yield cfg
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- plan
def test_plan_draft_size_matches_speculators_checkpoint_shapes():
    # Tensor shapes of a speculators 0.9.0 EAGLE-3 checkpoint for SmolLM2 (draft vocab 4096, ids [2,15,27,30]):
    # embed [49152,576] fc [576,1728] input_norm [1728] 3 layer norms [576] mlp 3x[1536,576]
    # q [576,1152] k,v [192,1152] o [576,576] lm_head [4096,576] norm [576]  -> 35,762,112 (read off runs/dev)
    smol = json.loads((REPO / "data" / "models" / "SmolLM2-135M-Instruct" / "config.json").read_text()) \
        if (REPO / "data/models/SmolLM2-135M-Instruct/config.json").exists() else {
            "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}
    d = plan_mod.draft_size(plan_mod.target_shape(smol), 4, 4096)
    assert d["total_params"] == 35_762_112
    assert d["trainable_params"] == 35_762_112 - 49152 * 576


def test_plan_matches_a_trained_checkpoint(trained_run):
    from safetensors import safe_open

    ckpt = trained_run.step_dir("train") / "checkpoint" / "model.safetensors"
    with safe_open(str(ckpt), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    conf = json.loads((trained_run.model_path / "config.json").read_text())
    d = plan_mod.draft_size(plan_mod.target_shape(conf), len(trained_run.extract.layer_ids),
                            trained_run.vocab.draft_vocab_size, trained_run.train.num_layers)
    assert d["total_params"] == n
    assert abs(d["checkpoint_bytes"] - ckpt.stat().st_size) < 0.001 * ckpt.stat().st_size


def test_plan_kimi_numbers(repo):
    cfg = load_config(repo / "configs" / "kimi-k2.5-devbox.toml")
    p10 = plan_mod.plan(cfg, KIMI, conversations=10_000, tokens_per_sample=2048, free=10**15, tokens_per_s=None)
    assert p10["target"]["layer_ids"] == [2, 30, 58, 61]
    assert p10["bytes_per_token"] == 4 * 7168 * 2 + 8  # 56 KiB + token id
    assert p10["tokens"] == 20_480_000
    assert p10["hidden_state_bytes"] == 20_480_000 * 57_352 + 10_000 * plan_mod.HEADER_BYTES
    assert p10["disk_sufficient"]  # 1.07 TiB on 909 TiB free
    assert not plan_mod.plan(cfg, KIMI, conversations=10_000, tokens_per_sample=2048, free=2**40)["disk_sufficient"]
    p100 = plan_mod.plan(cfg, KIMI, conversations=100_000, tokens_per_sample=2048, free=10 * 2**40, tokens_per_s=5000)
    assert not p100["disk_sufficient"] and p100["extract_seconds_estimate"] == 204_800_000 / 5000
    d = p10["draft"]
    assert d["params"]["lm_head (draft_vocab x H)"] == 32000 * 7168
    assert d["params"]["embed_tokens (target_vocab x H, frozen)"] == 163840 * 7168
    assert d["params"]["fc (aux*H -> H)"] == 3 * 7168 * 7168


def test_plan_estimates_without_prepare_and_says_so(fake_run):
    shutil.rmtree(fake_run.step_dir("prepare"))
    p = plan_mod.plan(fake_run, TINY, free=10**12)
    assert p["token_source"] == "estimate"
    assert p["tokens"] == fake_run.data.max_conversations * fake_run.data.seq_length // 2
    assert any("prepare has not run" in n and "seq_length/2" in n for n in p["notes"])


def test_plan_uses_prepared_tokens_and_measured_throughput(fake_run):
    p = plan_mod.plan(fake_run, TINY, free=10**12)
    assert p["token_source"].startswith("prepared") and p["samples"] == 7
    assert p["extract_seconds_estimate"] is None
    run(fake_run, "extract")
    p = plan_mod.plan(fake_run, TINY, free=10**12)
    tokens = read_manifest(fake_run.step_dir("extract"))["summary"]["tokens"]
    assert p["tokens"] == tokens and p["extract_tokens_per_s"] == round(tokens / 0.5, 1)
    # the plan's byte count is the files' real size (headers rounded up)
    real = read_manifest(fake_run.step_dir("extract"))["summary"]["bytes"]
    assert real <= p["hidden_state_bytes"] <= real + 7 * plan_mod.HEADER_BYTES


def test_plan_cli_prints_the_numbers(fake_run, capsys):
    from pipeline.__main__ import main

    assert main(["plan", "--config", fake_run.source_path]) == 0
    out = capsys.readouterr().out
    assert "tokens:" in out and "hidden states:" in out and "free" in out and "draft" in out


def test_extract_refuses_when_the_disk_is_too_small(fake_run, monkeypatch):
    monkeypatch.setattr(plan_mod, "free_bytes", lambda path: 100)
    with pytest.raises(StepError, match=r"not enough disk.*allow_insufficient_disk"):
        run(fake_run, "extract")
    assert fake_run.fake_calls == []  # refused before any engine work
    fake_run.extract.allow_insufficient_disk = True
    run(fake_run, "extract")
    assert read_manifest(fake_run.step_dir("extract"))


def test_allow_insufficient_disk_is_not_part_of_the_fingerprint(fake_run):
    a = fake_run.section_hash("extract")
    fake_run.extract.allow_insufficient_disk = True
    assert fake_run.section_hash("extract") == a


def test_verify_read_workers_is_in_neither_the_fingerprint_nor_compare(fake_run):
    """How many threads read verify's files changes how it runs, not what it computes."""
    from pipeline.compare import _what_it_computes

    a = fake_run.section_hash("verify")
    fake_run.verify.read_workers = 3
    assert fake_run.section_hash("verify") == a
    old = {"config_sections": {"verify": {"parity_samples": 8}}}
    new = {"config_sections": {"verify": {"parity_samples": 8, "read_workers": 3}}}
    other = {"config_sections": {"verify": {"parity_samples": 4, "read_workers": 3}}}
    assert _what_it_computes(old) == _what_it_computes(new) != _what_it_computes(other)


# ---------------------------------------------------------------- shards
def test_shard_slices_are_disjoint_and_cover_everything():
    items = list(range(23))
    parts = [extract_mod.shard_of(items, (i, 4)) for i in range(4)]
    assert sorted(x for p in parts for x in p) == items
    assert extract_mod.parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "a/b", "1", "-1/2"):
        with pytest.raises(StepError):
            extract_mod.parse_shard(bad)


def test_two_shards_cover_every_sample_exactly_once(fake_run):
    out = fake_run.step_dir("extract")
    r0 = run(fake_run, "extract", shard=(0, 2))
    assert "incomplete" in r0 and read_manifest(out) is None
    run(fake_run, "extract", shard=(0, 2))  # rerun of a finished shard redoes nothing
    assert fake_run.fake_calls[1:] == []
    m = run(fake_run, "extract", shard=(1, 2))
    assert m["status"] == "complete" and read_manifest(out)["summary"]["samples"] == 7
    done = [x for call in fake_run.fake_calls for x in call]
    assert sorted(done) == sorted((s, i) for s, n in SPLIT_SIZES.items() for i in range(n))  # once each
    frags = sorted(p.name for p in (out / "shards").glob("*.json"))
    assert frags == ["0-of-2.json", "1-of-2.json"]
    problems, files, broken = structural_problems(fake_run)
    assert problems == [] and len(files) == 7
    # the sharded output is the same output as one unsharded run's
    sharded_hash = m["outputs_hash"]
    m2 = run(fake_run, "extract", force=True)
    assert m2["outputs_hash"] == sharded_hash and not (out / "shards").exists()


def test_verify_finds_stray_missing_and_duplicated_samples(fake_run):
    run(fake_run, "extract", shard=(0, 2))
    run(fake_run, "extract", shard=(1, 2))
    out = fake_run.step_dir("extract")
    shutil.copy(out / "train" / file_name(0), out / "train" / file_name(99))
    (out / "eval" / file_name(1)).unlink()
    frag = json.loads((out / "shards" / "0-of-2.json").read_text())
    frag["samples"].append(["train", 1])  # shard 1's sample claimed again
    (out / "shards" / "0-of-2.json").write_text(json.dumps(frag))
    problems, _, _ = structural_problems(fake_run)
    text = "\n".join(problems)
    assert "train/hs_99.safetensors: stray file" in text
    assert "eval/hs_1.safetensors: missing" in text
    assert "train/hs_1.safetensors: claimed by several shards" in text


def test_coverage_flags_mixed_shard_counts(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / file_name(0)).write_bytes(b"x")
    (tmp_path / "train" / file_name(1)).write_bytes(b"x")
    for name, shard, samples in (("0-of-2.json", [0, 2], [["train", 0]]), ("0-of-3.json", [0, 3], [["train", 1]])):
        (tmp_path / "shards" / name).write_text(json.dumps({"shard": shard, "samples": samples}))
    problems = coverage_problems(tmp_path, [("train", 0), ("train", 1)])
    assert any("different shard counts" in p for p in problems)


def test_force_on_one_shard_redoes_only_that_shard(fake_run):
    run(fake_run, "extract", shard=(0, 2))
    run(fake_run, "extract", shard=(1, 2))
    fake_run.fake_calls.clear()
    run(fake_run, "extract", shard=(1, 2), force=True)
    assert fake_run.fake_calls == [[s for k, s in enumerate(
        [(sp, i) for sp, n in SPLIT_SIZES.items() for i in range(n)]) if k % 2 == 1]]
    assert read_manifest(fake_run.step_dir("extract"))["status"] == "complete"


def test_extraction_hash_follows_the_contents_so_verify_reruns(fake_run):
    """outputs_hash covers every file's bytes: a forced re-extraction that writes the same bytes keeps it (verify
    and later steps stay valid), one that changes a single value changes it, so verify's fingerprint moves and
    verify runs again instead of vouching for data it never saw. The same holds when one shard is redone."""
    from pipeline.hidden_states import DIGESTS
    from pipeline.steps import fingerprint

    out = fake_run.step_dir("extract")
    h0 = run(fake_run, "extract")["outputs_hash"]
    v0 = fingerprint(fake_run, "verify")
    assert set(json.loads((out / DIGESTS).read_text())) == {f"{s}/{file_name(i)}" for s, n in SPLIT_SIZES.items()
                                                             for i in range(n)}
    assert run(fake_run, "extract", force=True)["outputs_hash"] == h0  # same bytes (the fake is seeded)
    assert fingerprint(fake_run, "verify") == v0

    # one value changed, as a vLLM upgrade or a patch fix could do, then that file redone by a forced shard
    f = out / "train" / file_name(2)
    t = load_file(str(f))
    t["hidden_states"][0, 0, 0] += 1.0
    save_file(t, str(f))
    (out / "manifest.json").unlink()
    h1 = run(fake_run, "extract")["outputs_hash"]  # nothing to extract: the changed file is read again
    assert h1 != h0 and fingerprint(fake_run, "verify") != v0
    r = run(fake_run, "extract", shard=(0, 2), force=True)  # shard 0 holds train/hs_2 and rewrites it
    assert "no record yet from shard(s) 1/2" in r["incomplete"]  # every file is there, shard 1 has not said so
    m = run(fake_run, "extract", shard=(1, 2))  # records its files (nothing to extract) and completes the step
    assert m["summary"]["extracted_now"] == len(fake_run.fake_calls[-1]) and m["summary"]["shards"] == ["0/2", "1/2"]
    assert m["outputs_hash"] == h0 and fingerprint(fake_run, "verify") == v0
    assert structural_problems(fake_run)[0] == []  # the shard records cover every sample once


def test_content_digests_reuse_only_what_cannot_have_changed(tmp_path, monkeypatch):
    """A recorded hash is reused while size, mtime and inode match and the file was last modified well before it was
    hashed; a file hashed right after it was written, or rewritten since, is read again."""
    import os
    import time

    from pipeline import manifest
    from pipeline.hidden_states import RACY_NS, content_digests

    reads = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p, *a: reads.append(p.name) or real(p, *a))
    old, fresh = tmp_path / "old.bin", tmp_path / "fresh.bin"
    old.write_bytes(b"a" * 100)
    fresh.write_bytes(b"b" * 100)
    past = time.time_ns() - 10 * RACY_NS
    os.utime(old, ns=(past, past))
    d = content_digests(tmp_path, ["old.bin", "fresh.bin"], {})
    assert sorted(reads) == ["fresh.bin", "old.bin"]
    reads.clear()
    assert content_digests(tmp_path, ["old.bin", "fresh.bin"], d)["old.bin"] == d["old.bin"]
    assert reads == ["fresh.bin"]  # modified within RACY_NS of its hashing: not trusted
    reads.clear()
    old.write_bytes(b"c" * 100)  # same size, same inode, new mtime
    e = content_digests(tmp_path, ["old.bin"], d)
    assert reads == ["old.bin"] and e["old.bin"]["sha256"] != d["old.bin"]["sha256"]


def test_shard_is_refused_for_other_steps(fake_run):
    with pytest.raises(StepError, match="--shard"):
        run(fake_run, "train", shard=(0, 2))


# ---------------------------------------------------------------- manifests: determinism and provenance
def test_manifest_records_determinism_and_environment(fake_run, monkeypatch):
    from pipeline.determinism import apply

    monkeypatch.setenv("VLLM_TEST_MARKER", "1")
    monkeypatch.setenv("HF_TOKEN", "secret-value")
    for k in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED"):  # restored after the test
        monkeypatch.delenv(k, raising=False)
    try:
        apply(fake_run.run.seed)
        m = run(fake_run, "extract")
    finally:
        torch.use_deterministic_algorithms(False)
    d = m["determinism"]
    assert d["seed"] == fake_run.run.seed and d["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert d["env"]["PYTHONHASHSEED"] == str(fake_run.run.seed)
    assert d["deterministic_algorithms"] is True
    assert m["env"]["VLLM_TEST_MARKER"] == "1" and m["env"]["HF_TOKEN"] == "<set>"
    assert "image" in m and "gpu_driver" in m


# ---------------------------------------------------------------- compare
def _fake_downstream(run_dir: Path, scale: float, acceptance: float):
    """train checkpoint + eval.json with manifests, as the real steps lay them out."""
    (run_dir / "train" / "checkpoints" / "0").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"fc.weight": torch.randn(8, 16, generator=g) * scale, "d2t": torch.arange(4)},
              str(run_dir / "train" / "checkpoints" / "0" / "model.safetensors"))
    (run_dir / "train" / "checkpoint").symlink_to("checkpoints/0")
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "eval.json").write_text(json.dumps(
        {"drafters": {"trained": {"acceptance_length": acceptance, "tokens_per_s": 100 * acceptance}}}))
    for step in ("train", "eval"):
        write_json_atomic(run_dir / step / "manifest.json",
                          {"status": "complete", "outputs_hash": f"{step}-{scale}-{acceptance}", "inputs": {}})


def test_compare_identical_runs_and_the_first_divergence(fake_run):
    from pipeline.compare import compare_runs, main

    run(fake_run, "extract")
    a = fake_run.run_dir
    _fake_downstream(a, 1.0, 2.0)
    b = a.parent / "copy"
    shutil.copytree(a, b, symlinks=True)
    r = compare_runs(a, b)
    assert r["first_divergent_step"] is None
    assert {s["step"]: s["status"] for s in r["steps"]}["extract"] == "identical"
    assert main([str(a), str(b)]) == 0

    # a changed draft and eval only: first divergence at train, with a weight diff and a metric delta
    shutil.rmtree(b / "train"), shutil.rmtree(b / "eval")
    _fake_downstream(b, 1.5, 2.5)
    r = compare_runs(a, b)
    assert r["first_divergent_step"] == "train"
    rows = {s["step"]: s for s in r["steps"]}
    assert rows["train"]["contents"]["worst_tensor"] == "fc.weight"
    assert rows["train"]["contents"]["worst"]["max_abs_diff"] > 0
    assert rows["train"]["contents"]["min_cosine"] == pytest.approx(1.0)  # a scaled copy points the same way
    assert rows["eval"]["contents"]["deltas"]["drafters.trained.acceptance_length"] == pytest.approx(0.5)

    # one hidden-state value changed: the first divergence moves to extract, with its size
    f = b / "extract" / "train" / file_name(2)

    t = load_file(str(f))
    t["hidden_states"][0, 0, 0] += 1.0
    save_file(t, str(f))
    r = compare_runs(a, b)
    assert r["first_divergent_step"] == "extract"
    c = {s["step"]: s for s in r["steps"]}["extract"]["contents"]
    assert c["worst_file"] == "train/hs_2.safetensors" and c["max_abs_diff"] == pytest.approx(1.0, abs=0.02)
    assert c["bit_identical"] == c["files_compared"] - 1 and c["min_token_cosine"] < 1.0
    assert main([str(a), str(b)]) == 1


# ---------------------------------------------------------------- torchrun
def test_torchrun_command_follows_the_config(repo, tmp_path):
    import sys

    from pipeline.config import ConfigError
    from pipeline.train import _torchrun_command

    cmd = [sys.executable, "-m", "pipeline.engines.speculators_train", "--metrics", "m", "--", "--epochs", "1"]
    cfg = load_config(repo / "configs" / "smollm2-cpu.toml")
    assert _torchrun_command(cfg, cmd) == cmd  # 1 x 1: the single-process path, unchanged
    h = cfg.section_hash("train")
    cfg = load_config(repo / "configs" / "smollm2-cpu.toml", {"train.nproc_per_node": 2})
    assert _torchrun_command(cfg, cmd) == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                           "--nnodes", "1", "--standalone", "-m", *cmd[2:]]
    assert cfg.section_hash("train") != h  # the world size changes the global batch: a new fingerprint
    cfg = load_config(repo / "configs" / "smollm2-cpu.toml",
                      {"train.nproc_per_node": 8, "train.nnodes": 2, "train.rdzv_endpoint": "node0:29500"})
    got = _torchrun_command(cfg, cmd)
    assert got[got.index("--rdzv-endpoint") + 1] == "node0:29500" and got[got.index("--rdzv-id") + 1] == cfg.run.name
    assert "--standalone" not in got
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        load_config(repo / "configs" / "smollm2-cpu.toml", {"train.nnodes": 2})


def test_torchrun_two_process_gloo_training(data_run, runs_dir):
    """2-process DDP (gloo) through torchrun on CPU: needs patches/speculators/0.9.0/0005 (gloo when no
    accelerator); unpatched speculators raises 'No accelerator found'."""
    from tests.conftest import clone_run

    cfg = clone_run(data_run, "torchrun", runs_dir, train={"epochs": 1, "nproc_per_node": 2})
    run(cfg, "vocab")
    m = run(cfg, "train")
    log = (cfg.step_dir("train") / "train.log").read_text()
    assert "dp_size=2" in log
    assert (cfg.step_dir("train") / "checkpoint" / "model.safetensors").exists()
    assert m["summary"]["epochs"] == 1


def test_train_hashes_a_link_by_where_it_points_not_by_the_bytes_there(tmp_path):
    """train's data folder links every hidden-state file of the extraction (extract's outputs_hash covers their
    bytes): train's outputs_hash must not read them again (session 27: 73 GB re-read on the H200 after training,
    80 s). With follow_links=False (train's) a link counts by its target path, a file by its bytes; by default
    (a target folder of links to weights elsewhere) the bytes behind a link count."""
    from pipeline.manifest import hash_tree

    store, step = tmp_path / "store", tmp_path / "step"
    store.mkdir()
    step.mkdir()
    (store / "a.safetensors").write_bytes(b"hidden states")
    (step / "own.txt").write_text("a checkpoint")
    (step / "a.safetensors").symlink_to(store / "a.safetensors")
    h0, d0 = hash_tree(step, follow_links=False), hash_tree(step)
    (store / "a.safetensors").write_bytes(b"other bytes")  # the extraction's business, not this step's
    assert hash_tree(step, follow_links=False) == h0
    assert hash_tree(step) != d0  # followed: the bytes behind the link count
    (store / "a.safetensors").unlink()  # a dangling link is still where it points
    assert hash_tree(step, follow_links=False) == h0
    (step / "a.safetensors").unlink()
    (step / "a.safetensors").symlink_to(store / "b.safetensors")
    assert hash_tree(step, follow_links=False) != h0  # pointed elsewhere
    (step / "a.safetensors").unlink()
    (step / "a.safetensors").symlink_to(store / "a.safetensors")
    assert hash_tree(step, follow_links=False) == h0
    (step / "own.txt").write_text("another checkpoint")
    assert hash_tree(step, follow_links=False) != h0  # the step's own files count by their bytes
