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
