"""speculators' epoch checkpoint must let a resume continue exactly where training was (patch 0006).

speculators 0.9.0 saved the optimizer state and the weights in bf16 only, so a resumed run restarted from
rounded fp32 master weights and Adam moments, and Adam's float `step` above 256 came back rounded (301 -> 300).
Here a tiny Llama (fp32, embedding frozen as the drafter's is) takes 301 AdamW steps, is saved with the installed
(patched) SingleGPUCheckpointer, and is restored into a fresh model and optimizer: the optimizer state must come
back in fp32 with step 301 exactly, the trainable weights bit-exact, and one more step must give the same weights
as the uninterrupted model. The served weights (model.safetensors, config.json) must stay bf16. A few seconds on CPU.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

STEPS = 301  # bf16 rounds 301 to 300


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg).float()
    emb = model.model.embed_tokens.weight
    # frozen, and holding bf16 values, like the drafter's copy of a bf16 verifier's embedding: frozen tensors
    # come back from the bf16 model.safetensors (only the trainable ones are kept at full precision)
    emb.requires_grad_(False)
    emb.data = emb.data.bfloat16().float()
    return model


def _step(model, opt, i: int) -> None:
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from speculators.train.checkpointer import SingleGPUCheckpointer

    path = tmp_path_factory.mktemp("ckpt")
    model = _model(0)
    opt = _adamw(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small steps ~25x faster on one thread than on two busy cores
    try:
        for i in range(STEPS):
            _step(model, opt, i)
    finally:
        torch.set_num_threads(threads)
    SingleGPUCheckpointer(path).save_checkpoint(model, [opt], 0)
    return path, model, opt


def test_resume_restores_full_precision_optimizer_state_and_weights(saved):
    from speculators.train.checkpointer import SingleGPUCheckpointer

    path, model, opt = saved
    ck = SingleGPUCheckpointer(path)
    assert ck.previous_epoch == 0
    model2 = _model(1)  # other random init: everything trainable must come from the checkpoint
    opt2 = _adamw(model2)
    ck.load_model_state_dict(model2)
    ck.load_optimizer_state_dict(model2, [opt2])

    steps = {float(s["step"]) for s in opt2.state.values()}
    assert steps == {float(STEPS)}, f"Adam's step came back as {steps}, not {STEPS} (saved in bf16?)"
    for s in opt2.state.values():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert s[k].dtype == torch.float32, (k, s[k].dtype)
    for (k, a), (k2, b) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items()):
        assert k == k2
        for name in a:
            assert torch.equal(a[name], b[name]), f"optimizer state {k}.{name} differs after the round trip"
    sd, sd2 = model.state_dict(), model2.state_dict()
    differ = [k for k in sd if not torch.equal(sd[k], sd2[k])]
    assert not differ, f"weights not restored exactly: {differ}"

    # one more step on both: the resumed model continues exactly as the uninterrupted one
    _step(model2, opt2, STEPS)
    ref = _model(0)
    ref.load_state_dict(sd)
    ref_opt = _adamw(ref)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(ref, ref_opt, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model2.parameters()))


def test_served_weights_stay_bf16(saved):
    from safetensors import safe_open

    path = saved[0] / "0"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}, dtypes
    conf = json.loads((path / "config.json").read_text())
    assert conf.get("dtype", conf.get("torch_dtype")) == "bfloat16"
