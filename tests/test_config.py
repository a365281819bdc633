import pytest

from pipeline.config import ConfigError, load_config
from tests.conftest import write_config


def test_default_config_loads(repo):
    cfg = load_config(repo / "configs" / "smollm2-cpu.toml")
    assert cfg.run.stack == "vllm-0.32"
    assert cfg.model.max_model_len >= cfg.data.seq_length
    assert cfg.eval.num_speculative_tokens == 3


def test_unknown_key_is_rejected_with_file_and_allowed_keys(tmp_path):
    p = write_config(tmp_path / "c.toml", tmp_path, "x", data={"max_conversation": 3})
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "max_conversation" in msg and "max_conversations" in msg


def test_unknown_section_is_rejected(tmp_path):
    p = write_config(tmp_path / "c.toml", tmp_path, "x", trian={"epochs": 1})
    with pytest.raises(ConfigError, match="trian"):
        load_config(p)


def test_wrong_type_and_bad_choice(tmp_path):
    p = write_config(tmp_path / "c.toml", tmp_path, "x", train={"epochs": "ten"})
    with pytest.raises(ConfigError, match="train.epochs must be int"):
        load_config(p)
    p = write_config(tmp_path / "c.toml", tmp_path, "x", data={"regenerate": "sometimes"})
    with pytest.raises(ConfigError, match="first_turn"):
        load_config(p)


def test_section_hash_tracks_only_named_sections(tmp_path):
    a = load_config(write_config(tmp_path / "a.toml", tmp_path, "x"))
    b = load_config(write_config(tmp_path / "b.toml", tmp_path, "x", train={"epochs": 99}))
    assert a.section_hash("data") == b.section_hash("data")
    assert a.section_hash("train") != b.section_hash("train")


def test_engine_keys_are_real_vllm_arguments():
    """[engine] reaches vLLM as LLM(**kwargs) (prepare, eval) and as `vllm serve` flags (extract): both forms are
    checked against the installed vLLM's own EngineArgs and its CLI parser, so a renamed argument fails here."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from pipeline.config import EngineConfig

    e = EngineConfig(tensor_parallel_size=8, pipeline_parallel_size=2, enable_expert_parallel=True,
                     gpu_memory_utilization=0.9, max_num_seqs=64, kv_cache_dtype="fp8", attention_backend="CPU_MLA")
    kw = e.llm_kwargs()
    assert set(kw) == {"tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                       "gpu_memory_utilization", "max_num_seqs", "kv_cache_dtype", "attention_backend"}
    assert set(kw) <= {f.name for f in dataclasses.fields(EngineArgs)}
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(e.cli_args())
    assert {k: getattr(ns, k) for k in kw} == kw
    assert EngineConfig().llm_kwargs() == {} and EngineConfig().cli_args() == []  # defaults: vLLM's own


def test_engine_section_is_validated_and_not_fingerprinted(tmp_path):
    from pipeline.config import ConfigError, load_config

    p = tmp_path / "c.toml"
    p.write_text("[engine]\ntensor_parallel_size = 0\n")
    with pytest.raises(ConfigError, match=r"c\.toml: engine\.tensor_parallel_size"):
        load_config(p)
    p.write_text("[engine]\ngpu_memory_utilization = 1.5\n")
    with pytest.raises(ConfigError, match=r"engine\.gpu_memory_utilization"):
        load_config(p)
    p.write_text("[engine]\ntensor_parallel_size = 8\nmax_num_seqs = 4\n")
    cfg, base = load_config(p), load_config(p, {"engine.tensor_parallel_size": 1})
    from pipeline.steps import STEPS

    for step, (_, sections, _, _) in STEPS.items():
        assert cfg.section_hash(*sections) == base.section_hash(*sections), step


def test_cpu_configs_compute_in_float32(repo):
    """Every CPU config computes in float32: on a CPU without bf16 instructions bf16 runs ~90x slower (NOTES.md,
    "CPU dtype"), and fp32 gives every CPU host the same numbers. The weights stay bf16 (model.precision)."""
    cpu = sorted((repo / "configs").glob("smollm2-cpu*.toml"))
    assert len(cpu) >= 4
    for path in cpu:
        cfg = load_config(path)
        assert (cfg.model.dtype, cfg.eval.dtype, cfg.model.precision) == ("float32", "float32", "bf16"), path.name


def test_bf16_on_a_cpu_without_bf16_instructions_is_named():
    import torch

    from pipeline.env import slow_cpu_dtype

    if torch.cuda.is_available():
        pytest.skip("the warning is for CPU-only hosts")
    msg = slow_cpu_dtype("bfloat16", "eval.dtype", {"avx2", "fma", "f16c"})  # an AMD EPYC Zen 3
    assert msg and 'Set eval.dtype = "float32"' in msg
    assert slow_cpu_dtype("bfloat16", "eval.dtype", {"avx2", "avx512f", "avx512_bf16"}) is None
    assert slow_cpu_dtype("bfloat16", "eval.dtype", {"avx2", "amx_bf16", "amx_tile"}) is None
    assert slow_cpu_dtype("float32", "eval.dtype", {"avx2"}) is None


def test_muon_newton_schulz_runs_in_float32_on_cpu():
    """speculators' default optimizer (torch.optim.Muon) orthogonalizes in bf16; on the CPU the train step swaps in
    the same iteration in float32 (28 s of a 30 s step went to it on an AVX2 host). Same result to bf16 noise."""
    import torch
    import torch.optim._muon as muon

    from pipeline.engines.speculators_train import float32_newton_schulz_on_cpu

    if torch.cuda.is_available():
        pytest.skip("GPUs keep torch's bf16 iteration")
    original = muon._zeropower_via_newtonschulz
    try:
        assert float32_newton_schulz_on_cpu()
        coeffs = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
        for shape in ((48, 80), (80, 48)):
            g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
            ours, theirs = muon._zeropower_via_newtonschulz(g, coeffs, 5, 1e-7), original(g, coeffs, 5, 1e-7)
            assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16 and ours.shape == g.shape
            cos = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.float().flatten(), dim=0)
            assert cos > 0.999, cos
            assert not torch.allclose(ours, theirs.float(), atol=0, rtol=0)  # computed apart, not the same bf16 call
    finally:
        muon._zeropower_via_newtonschulz = original


def test_verify_device_is_a_choice_fingerprinted_only_away_from_cpu(tmp_path):
    """verify.device moves the transformers reference (session 24: 213 s of CPU work on the H200). Runs from before
    the key existed keep their verify fingerprint; a reference on another device is another verification."""
    import torch

    from pipeline.engines.hf_reference import resolve_device

    with pytest.raises(ConfigError, match=r"verify\.device = 'gpu'; expected one of \['auto', 'cpu', 'cuda'\]"):
        load_config(write_config(tmp_path / "c.toml", tmp_path, "x", verify={"device": "gpu"}))
    base = load_config(write_config(tmp_path / "a.toml", tmp_path, "x"))
    cpu = load_config(write_config(tmp_path / "b.toml", tmp_path, "x", verify={"device": "cpu"}))
    auto = load_config(write_config(tmp_path / "d.toml", tmp_path, "x", verify={"device": "auto"}))
    assert base.verify.device == "cpu" and base.section_hash("verify") == cpu.section_hash("verify")
    assert auto.section_hash("verify") != base.section_hash("verify")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # asked for a GPU that is not there: said, with the key that fixes it
        with pytest.raises(RuntimeError, match=r"no CUDA device.*verify\.device = \"cpu\""):
            resolve_device("cuda")


def test_verify_checks_on_one_torch_thread_beside_a_gpu_reference_and_restores_the_rest(monkeypatch):
    """Beside verify's reader threads torch's default team took 81 ms a file on the H200, one thread 1.14 ms
    (session 26): with the reference on a GPU the checks run on one thread; on the CPU, whose reference forward needs
    the team, nothing changes; and whatever happens in the step, the process gets its thread count back."""
    import torch

    from pipeline import verify

    default = torch.get_num_threads()
    try:
        assert verify.one_torch_thread_beside_readers(torch.device("cpu")) == default
        assert verify.one_torch_thread_beside_readers(torch.device("cuda")) == 1
    finally:
        torch.set_num_threads(default)

    def fails(cfg, out):
        verify.one_torch_thread_beside_readers(torch.device("cuda"))
        raise RuntimeError("a step that dies mid-way")

    monkeypatch.setattr(verify, "_run", fails)
    with pytest.raises(RuntimeError, match="mid-way"):
        verify.run(None, None)
    assert torch.get_num_threads() == default


def test_a_dirty_checkout_records_the_tree_that_ran(tmp_path):
    """A copy of a newer tree beside an older .git reads as the older commit, dirty; `tree` names the content itself:
    equal to the tree of the commit that holds exactly those files, and the checkout's own index stays as it was."""
    import subprocess

    from pipeline.manifest import git_commit

    def git(*a):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "step.py").write_text("a = 1\n")
    (tmp_path / ".gitignore").write_text("cache/\n")
    git("add", "-A"); git("commit", "-qm", "old")
    old = git("rev-parse", "HEAD")
    clean = git_commit(tmp_path)
    assert clean == {"commit": old, "dirty": False}
    (tmp_path / "step.py").write_text("a = 2\n")       # the newer tree: a changed file, a new one, an ignored one
    (tmp_path / "new.py").write_text("b = 1\n")
    (tmp_path / "cache").mkdir(); (tmp_path / "cache" / "x").write_text("litter\n")
    staged = git("ls-files", "--stage")  # (the index file's bytes may change: git status refreshes its stat data)
    ran = git_commit(tmp_path)
    assert ran["commit"] == old and ran["dirty"] is True
    assert git("ls-files", "--stage") == staged and "new.py" not in staged
    git("add", "-A"); git("commit", "-qm", "new")
    assert ran["tree"] == git("rev-parse", "HEAD^{tree}") != git("rev-parse", f"{old}^{{tree}}")
