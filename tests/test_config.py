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
