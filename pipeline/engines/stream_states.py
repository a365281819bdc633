"""Training on hidden states computed on the fly (`train.hidden_states = "stream"`): no extract, no disk.

The disk path reads runs/<run>/extract/<split>/hs_<i>.safetensors, which the extract step wrote with
`hf_engine.hidden_states_batch` (or vLLM). The stream path computes the same tensors with that same function,
one training batch at a time, on the training device, right before the draft's forward. speculators' own data
loading, packing, shifting and collation stay as they are; three things are put around them
(`install`, called by `pipeline.engines.speculators_train` before speculators starts):

1. `StreamTransfer` replaces speculators' file transfer: a sample's "hidden states" are a zero-width placeholder
   [T, L, 0] beside its token ids, so speculators packs batches exactly as on the disk path without reading a file.
2. `shift_keeping_ids` replaces speculators' eagle3 `shift_batch`: the same shift (token t+1 with state t), plus the
   unshifted ids under `stream_prev_ids`, which the collate packs like every per-token key. The shift drops each
   sample's first token from `input_ids`, so without this the batch could not be turned back into the target's input.
3. A forward pre-hook on the draft model rebuilds each packed sample's full token ids (`stream_prev_ids` + its last
   input id), runs the target on them (right-padded batch, no autocast, the target's dtype as extract), and puts
   in the rows the disk path would hold: hidden_states = aux states of tokens 0..n-2, verifier_last_hidden_states =
   the last-layer state of tokens 1..n-1, cast to the collate's dtype. Padding rows stay zero, as on disk.

These three are picklable module-level objects, so speculators' spawned data-loader workers import them from here.
"""
from __future__ import annotations

import torch

PREV_IDS = "stream_prev_ids"


class StreamTransfer:
    """speculators `HiddenStatesTransfer` for the stream path: placeholders, never a file."""

    def __init__(self, data_path: str, num_layers: int):
        self.data_path = str(data_path)
        self.num_layers = num_layers
        self._ds = None

    def __getstate__(self):  # the dataset handle is reopened in each worker
        return {**self.__dict__, "_ds": None}

    def setup(self) -> None:
        pass

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        if self._ds is None:
            from datasets import load_from_disk

            self._ds = load_from_disk(self.data_path).with_format("torch", columns=["input_ids"])
        ids = self._ds[file_idx]["input_ids"]
        return {"hidden_states": torch.zeros(len(ids), self.num_layers, 0), "token_ids": ids}

    def get_generated(self, hs_transfer_params):
        raise RuntimeError("train.hidden_states = 'stream' computes every sample; nothing is generated elsewhere")

    def delete(self, handle: str) -> None:
        pass


def shift_keeping_ids(batch: dict) -> dict:
    """speculators' eagle3 shift_batch, plus the unshifted ids (aligned with the shifted rows: x0 .. x_{n-2})."""
    from speculators.models.eagle3.data import shift_batch

    prev = batch["input_ids"][:-1]
    out = shift_batch(batch)
    out[PREV_IDS] = prev
    return out


class TargetStates:
    """The forward pre-hook: fills the placeholders of a packed batch with the target's states."""

    def __init__(self, model_path: str, layer_ids: list[int], dtype: str, trust_remote_code: bool = False):
        self.model_path, self.layer_ids, self.dtype = model_path, list(layer_ids), dtype
        self.trust_remote_code = trust_remote_code
        self.model = None

    def _target(self, dev: torch.device):
        if self.model is None:
            from .hf_engine import load_target

            self.model = load_target(self.model_path, self.dtype, self.trust_remote_code, dev=dev)
            for p in self.model.parameters():
                p.requires_grad_(False)
        return self.model

    def __call__(self, _module, args, kwargs):
        prev = kwargs.pop(PREV_IDS, None)
        if prev is None or kwargs["hidden_states"].shape[-1] != 0:
            return args, kwargs  # a disk batch, or speculators' all-padding stand-in for an empty batch
        ids, docs = kwargs["input_ids"][0], kwargs["document_ids"][0]
        dev = ids.device
        model = self._target(dev)
        n_docs = int(docs.max().item()) + 1 if docs.numel() else 0
        counts = torch.bincount(docs[docs >= 0], minlength=n_docs).tolist() if n_docs else []
        seqs, starts, off = [], [], 0
        for c in counts:  # packed samples are contiguous, in document order
            if c > 0:
                seqs.append(torch.cat([prev[0, off:off + c], ids[off + c - 1:off + c]]).tolist())
                starts.append(off)
            off += c
        width = len(self.layer_ids)
        hidden = model.config.get_text_config().hidden_size
        out_dtype = kwargs["hidden_states"].dtype
        total = ids.shape[0]
        hs = torch.zeros(1, total, (width - 1) * hidden, dtype=out_dtype, device=dev)
        last = torch.zeros(1, total, hidden, dtype=out_dtype, device=dev)
        if seqs:
            from .hf_engine import hidden_states_batch

            with torch.autocast(dev.type, enabled=False):
                states = hidden_states_batch(model, seqs, self.layer_ids)
            for start, seq, st in zip(starts, seqs, states):  # st: [n, L, H] in the target's dtype, as extract saves
                n = len(seq) - 1
                hs[0, start:start + n] = st[:-1, :-1].flatten(1).to(out_dtype)
                last[0, start:start + n] = st[1:, -1].to(out_dtype)
        kwargs["hidden_states"], kwargs["verifier_last_hidden_states"] = hs, last
        return args, kwargs


def install(model_path: str, layer_ids: list[int], dtype: str, trust_remote_code: bool = False) -> TargetStates:
    """Wire the stream path into speculators' train CLI (call before it starts)."""
    import speculators.train.cli as cli
    from speculators.train.trainer import Trainer

    hook = TargetStates(model_path, layer_ids, dtype, trust_remote_code)
    make_loaders = cli.create_train_val_loaders

    def create_train_val_loaders(*a, **kw):
        kw["transfer"] = StreamTransfer(kw["data_path"], len(layer_ids))
        kw["preprocess"] = shift_keeping_ids
        return make_loaders(*a, **kw)

    cli.create_train_val_loaders = create_train_val_loaders
    setup_model = Trainer.setup_model

    def setup_model_with_hook(self, *a, **kw):
        result = setup_model(self, *a, **kw)
        self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return result

    Trainer.setup_model = setup_model_with_hook
    return hook
