"""One transformers evaluation run in its own process: greedy generation, with or without an EAGLE-3 draft.

`python -m pipeline.engines.hf_spec_eval request.json result.json` takes the request of
pipeline.engines.vllm_eval and writes the same result (outputs, texts, generation_s, startup_s,
output_tokens, spec_decode {drafts, draft_tokens, accepted_tokens, accepted_per_pos}), for hosts where
vLLM cannot be installed.

Without a speculative_config: greedy decoding, one prompt at a time (the same batch size as the
speculative run, so the speedup compares like with like). request["batch_size"] = B > 1 (default 1)
decodes B consecutive prompts together instead (decode_batch), with or without a draft: the same
outputs and counters per prompt as batch 1 (up to argmax flips from padded-batch numerics), and
generation_s then measures tokens/s at batch B. With one: exact greedy chain speculative
decoding with the EAGLE-3 draft that speculators 0.9.0 writes (<dir>/config.json + model.safetensors),
following vLLM 0.32's Eagle3LlamaForCausalLM and EagleProposer:
  * the target's aux hidden states at the checkpoint's eagle_aux_hidden_state_layer_ids (vLLM
    convention, ascending), concatenated -> [input_norm if norm_before_fc] -> [fc_norm per chunk] -> fc;
  * every committed position t feeds the draft the pair (embedding of token t+1, target feature at t)
    at position t, kept in the draft's KV cache; the proposal starts from the last committed position
    (its token is the one the target just sampled), later steps feed the draft's own output hidden
    state (post-norm if norm_output, else the pre-norm residual stream) and its own argmax token at
    the next position; draft ids map to target ids as d + d2t[d];
  * the target checks the K drafts in one forward pass over [last token, d1..dK]: the longest prefix
    equal to its greedy argmax is accepted, plus its next token (correction or bonus).
Counting follows vLLM's scheduler and SpecDecodingStats: a "draft" is one verified proposal (made after
every target step, including the prefill, and counted when the next step verifies it, so never after
the request finished); draft_tokens adds the number of proposed tokens actually scheduled (K; fewer only
where max_model_len cuts the step, never because max_tokens is near: vLLM schedules all K and truncates
the output afterwards);
accepted_tokens adds the verified prefix length, counted before the output is truncated at EOS or
max_tokens (tokens accepted past either still count, as in vLLM); accepted_per_pos[i] counts drafts whose
first i+1 tokens were accepted.

Batched decoding (decode_batch) keeps B rows in one shared target cache with "holes": prompts are
left-padded, every verification step appends 1 + n columns to every row (n = the largest n_spec of
the batch), and a 2-D attention mask [B, cache columns] zeroes the padding, the draft slots a row did
not use and the drafts the target rejected (instead of cropping, which a shared cache cannot do per
row); position_ids are explicit, so RoPE sees each row's real positions. The draft's batched cache
(DraftBatchCache) does the same: ragged feeds of accepted pairs are left-padded, every column carries
its position and a validity bit, and attention allows valid keys at positions <= the query's. Rows
that finish leave the batch (index selection of both caches). The counting rules above apply per row.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .hf_engine import capture_layers, device, load_target, stop_token_ids


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Eagle3Draft:
    """An EAGLE-3 draft checkpoint of speculators 0.9.0, evaluated as vLLM does (see module doc).

    Weights come straight from model.safetensors (no speculators import, so it runs wherever the
    target runs); the rotary embedding is transformers' for the draft's transformer_layer_config."""

    def __init__(self, path, target, dtype: torch.dtype, dev: torch.device):
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        conf = json.loads((path / "config.json").read_text())
        if conf.get("speculators_model_type", "eagle3") != "eagle3":
            raise ValueError(f"{path}: not an EAGLE-3 draft (speculators_model_type={conf.get('speculators_model_type')})")
        tl = dict(conf["transformer_layer_config"])
        if tl.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: draft hidden_act {tl['hidden_act']!r} is not supported (silu only)")
        w = load_file(str(path / "model.safetensors"))
        self.dev, self.dtype = dev, dtype
        n_target = len(_target_layers(target))
        ids = conf.get("eagle_aux_hidden_state_layer_ids") or [2, n_target // 2, n_target - 3]
        self.aux_ids = sorted(ids)  # vLLM collects aux states in layer order
        self.eps = float(tl["rms_norm_eps"])
        self.hidden = int(tl["hidden_size"])
        self.heads = int(tl["num_attention_heads"])
        self.kv_heads = int(tl.get("num_key_value_heads") or self.heads)
        self.head_dim = int(tl.get("head_dim") or self.hidden // self.heads)
        self.norm_before_residual = bool(conf.get("norm_before_residual", True))  # vLLM's defaults
        self.norm_output = bool(conf.get("norm_output", False))
        self.num_layers = int(tl["num_hidden_layers"])
        layer_types = tl.get("layer_types") or []
        window = tl.get("sliding_window")
        self.windows = [window if i < len(layer_types) and layer_types[i] == "sliding_attention" else None
                        for i in range(self.num_layers)]

        def get(name, default=None):
            t = w.get(name, default)
            return None if t is None else t.to(dev, dtype)

        self.embed = get("embed_tokens.weight")
        if self.embed is None:  # vLLM shares the target's embedding when the draft has none
            self.embed = target.get_input_embeddings().weight.detach().to(dtype)
        self.lm_head = get("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = target.get_output_embeddings().weight.detach().to(dtype)
        self.fc = get("fc.weight")
        self.input_norm = get("input_norm.weight") if conf.get("norm_before_fc", False) else None
        self.fc_norm = None
        if conf.get("fc_norm", False):
            self.fc_norm = [get(f"fc_norm.{i}.weight") for i in range(len(self.aux_ids))]
        self.norm = get("norm.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            self.layers.append({k: get(p + k) for k in (
                "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.v_proj.bias", "self_attn.o_proj.bias", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")})
        d2t = w.get("d2t")
        draft_vocab = self.lm_head.shape[0]
        self.draft_to_target = None
        if d2t is not None and draft_vocab != target.config.get_text_config().vocab_size:
            self.draft_to_target = (torch.arange(draft_vocab) + d2t.long()).to(dev)
        elif draft_vocab != target.config.get_text_config().vocab_size:
            raise ValueError(f"{path}: draft vocab {draft_vocab} != target vocab and no d2t map")

        rope_conf = AutoConfig.for_model(tl.get("model_type", "llama"), **{k: v for k, v in tl.items() if k != "model_type"})
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(rope_conf).to(dev)
        self.reset()

    # --- state ---
    def reset(self) -> None:
        self.k_cache = [None] * self.num_layers
        self.v_cache = [None] * self.num_layers

    @property
    def cached(self) -> int:
        return 0 if self.k_cache[0] is None else self.k_cache[0].shape[1]

    def crop(self, n: int) -> None:
        self.k_cache = [None if k is None else k[:, :n] for k in self.k_cache]
        self.v_cache = [None if v is None else v[:, :n] for v in self.v_cache]

    # --- math ---
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux hidden states [T, n_aux * H] -> draft input features [T, H]."""
        x = aux.to(self.dtype)
        if self.input_norm is not None:
            x = _rms(x, self.input_norm, self.eps)
        if self.fc_norm is not None:
            x = torch.cat([_rms(c, n, self.eps) for n, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1)
        return F.linear(x, self.fc)

    def _attn(self, i: int, lw: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = F.linear(x, lw["self_attn.q_proj.weight"], lw["self_attn.q_proj.bias"]).view(t, self.heads, self.head_dim)
        k = F.linear(x, lw["self_attn.k_proj.weight"], lw["self_attn.k_proj.bias"]).view(t, self.kv_heads, self.head_dim)
        v = F.linear(x, lw["self_attn.v_proj.weight"], lw["self_attn.v_proj.bias"]).view(t, self.kv_heads, self.head_dim)
        if lw["self_attn.q_norm.weight"] is not None:  # qwen3-style drafts
            q = _rms(q, lw["self_attn.q_norm.weight"], self.eps)
            k = _rms(k, lw["self_attn.k_norm.weight"], self.eps)
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [h, T, d]
        if self.k_cache[i] is not None:
            k = torch.cat([self.k_cache[i], k], dim=1)
            v = torch.cat([self.v_cache[i], v], dim=1)
        self.k_cache[i], self.v_cache[i] = k, v
        # the cache holds positions 0..S-1 contiguously: key j sits at position j
        kpos = torch.arange(k.shape[1], device=x.device)
        allowed = kpos[None, :] <= positions[:, None]
        if self.windows[i]:
            allowed &= positions[:, None] - kpos[None, :] < self.windows[i]
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed[None, None])[0]
        o = o.transpose(0, 1).reshape(t, self.heads * self.head_dim)
        return F.linear(o, lw["self_attn.o_proj.weight"], lw["self_attn.o_proj.bias"])

    def _mlp(self, lw: dict, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, lw["mlp.gate_proj.weight"])) * F.linear(x, lw["mlp.up_proj.weight"]),
                        lw["mlp.down_proj.weight"])

    def forward(self, token_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor):
        """Tokens [T] (target ids), features [T, H], positions [T] (appended to the KV cache) ->
        (post-norm hidden states for the logits, hidden states fed to the next step)."""
        return self._layers(token_ids, feats, lambda i, lw, x: self._attn(i, lw, x, positions))

    def _layers(self, token_ids: torch.Tensor, feats: torch.Tensor, attn):
        """The decoder stack on tokens [..., T] and features [..., T, H]; attn(i, weights, x) is the
        attention of layer i (it owns the KV cache: single-sequence or batched)."""
        emb = F.embedding(token_ids, self.embed)
        residual = None
        h = feats
        for i, lw in enumerate(self.layers):
            if i == 0:
                e = _rms(emb, lw["input_layernorm.weight"], self.eps)
                if self.norm_before_residual:
                    h = _rms(h, lw["hidden_norm.weight"], self.eps)
                    residual = h
                else:
                    residual = h
                    h = _rms(h, lw["hidden_norm.weight"], self.eps)
                x = torch.cat([e, h], dim=-1)
            else:
                residual = h + residual
                x = _rms(residual, lw["input_layernorm.weight"], self.eps)
            a = attn(i, lw, x)
            residual = a + residual
            h = self._mlp(lw, _rms(residual, lw["post_attention_layernorm.weight"], self.eps))
        prenorm = h + residual
        post = _rms(prenorm, self.norm, self.eps)
        return post, (post if self.norm_output else prenorm)

    def argmax(self, post: torch.Tensor) -> torch.Tensor:
        d = F.linear(post, self.lm_head).argmax(dim=-1)
        return d if self.draft_to_target is None else self.draft_to_target[d]

    def propose(self, token_ids: torch.Tensor, aux: torch.Tensor, start: int, k: int) -> list[int]:
        """Feed committed pairs at positions start.. (tokens t+1, target aux at t), then chain k tokens.
        The draft's own speculative KV entries are dropped afterwards (vLLM overwrites them)."""
        assert start == self.cached, (start, self.cached)
        pos = torch.arange(start, start + token_ids.shape[0], device=self.dev)
        post, hid = self.forward(token_ids, self.combine(aux), pos)
        committed = self.cached
        tok = self.argmax(post[-1:])
        out, hid, p = [tok], hid[-1:], pos[-1:]
        for _ in range(k - 1):
            p = p + 1
            post, hid = self.forward(tok, hid, p)
            tok = self.argmax(post)
            out.append(tok)
        self.crop(committed)
        return torch.cat(out).tolist()

    # --- batched (decode_batch): the KV cache lives in a DraftBatchCache, one row per prompt ---
    def _attn_batch(self, i: int, lw: dict, x: torch.Tensor, positions: torch.Tensor,
                    cache: "DraftBatchCache") -> torch.Tensor:
        """_attn for rows [B, T, *]: keys are allowed where the cache marks them valid and their
        position is <= the query's (cache columns are not positions here: rows are ragged)."""
        b, t = x.shape[:2]
        q = F.linear(x, lw["self_attn.q_proj.weight"], lw["self_attn.q_proj.bias"]).view(b, t, self.heads, self.head_dim)
        k = F.linear(x, lw["self_attn.k_proj.weight"], lw["self_attn.k_proj.bias"]).view(b, t, self.kv_heads, self.head_dim)
        v = F.linear(x, lw["self_attn.v_proj.weight"], lw["self_attn.v_proj.bias"]).view(b, t, self.kv_heads, self.head_dim)
        if lw["self_attn.q_norm.weight"] is not None:
            q = _rms(q, lw["self_attn.q_norm.weight"], self.eps)
            k = _rms(k, lw["self_attn.k_norm.weight"], self.eps)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, h, T, d]
        k, v = cache.append_kv(i, k, v)
        # mask [B, T, S]: a key counts for a query when it is a real (not padding) entry of the
        # row and not after the query's position (the causal rule on positions, as in _attn)
        kpos, kvalid = cache.pos[:, None, :], cache.valid[:, None, :]
        allowed = kvalid & (kpos <= positions[:, :, None])
        if self.windows[i]:
            allowed &= positions[:, :, None] - kpos < self.windows[i]
        # a padding query may see no key at all; let it see every key (its output is never used)
        # so that SDPA does not return NaN
        allowed |= ~allowed.any(-1, keepdim=True)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return F.linear(o, lw["self_attn.o_proj.weight"], lw["self_attn.o_proj.bias"])

    def forward_batch(self, token_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, cache: "DraftBatchCache"):
        """forward() for B rows: tokens [B, T], features [B, T, H], positions [B, T], valid [B, T]
        (False = padding: written to the cache but never attended to)."""
        cache.append_positions(positions, valid)
        return self._layers(token_ids, feats, lambda i, lw, x: self._attn_batch(i, lw, x, positions, cache))

    def propose_batch(self, cache: "DraftBatchCache", token_ids: torch.Tensor, aux: torch.Tensor,
                      positions: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
        """propose() for B rows: feed the committed pairs (left-padded, so each row's last pair is
        the last column), then chain k tokens per row -> [B, k] target ids."""
        post, hid = self.forward_batch(token_ids, self.combine(aux), positions, valid, cache)
        committed = cache.length
        tok = self.argmax(post[:, -1])  # [B]
        out, hid, p = [tok], hid[:, -1:], positions[:, -1:]
        every = torch.ones_like(p, dtype=torch.bool)
        for _ in range(k - 1):
            p = p + 1
            post, hid = self.forward_batch(tok[:, None], hid, p, every, cache)
            tok = self.argmax(post[:, 0])
            out.append(tok)
        cache.crop(committed)
        return torch.stack(out, dim=1)


class DraftBatchCache:
    """The draft's KV cache for B rows: keys/values [B, kv_heads, S, d] per layer plus, per column,
    the position [B, S] and whether it is a real entry [B, S] (padding of ragged feeds is not)."""

    def __init__(self, num_layers: int, batch: int, dev: torch.device):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos = torch.zeros((batch, 0), dtype=torch.long, device=dev)
        self.valid = torch.zeros((batch, 0), dtype=torch.bool, device=dev)

    @property
    def length(self) -> int:
        return self.pos.shape[1]

    def append_positions(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self.pos = torch.cat([self.pos, positions], dim=1)
        self.valid = torch.cat([self.valid, valid], dim=1)

    def append_kv(self, i: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v

    def crop(self, n: int) -> None:
        self.k = [None if k is None else k[:, :, :n] for k in self.k]
        self.v = [None if v is None else v[:, :, :n] for v in self.v]
        self.pos, self.valid = self.pos[:, :n], self.valid[:, :n]

    def select(self, rows: torch.Tensor) -> None:
        self.k = [None if k is None else k[rows] for k in self.k]
        self.v = [None if v is None else v[rows] for v in self.v]
        self.pos, self.valid = self.pos[rows], self.valid[rows]


def _target_layers(model):
    from .hf_reference import decoder_layers

    return decoder_layers(model)


def _crop(cache, n: int) -> None:
    """Keep the first n positions of a transformers DynamicCache (negative crop = tokens to remove,
    the same meaning in transformers 4.x and 5.x)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def decode(target, prompt: list[int], *, max_tokens: int, max_model_len: int, stop: set[int],
           draft: Eagle3Draft | None = None, k: int = 0, stats: dict | None = None,
           proposals: list | None = None) -> list[int]:
    """Greedy output of one prompt; with a draft, by chain speculative decoding (same output).
    `proposals`, if given, receives every verified proposal (a list of token ids), for tests."""
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    aux_ids = draft.aux_ids if draft is not None else []
    cache = DynamicCache()
    seq = list(prompt)
    out: list[int] = []
    limit = min(max_tokens, max_model_len - len(prompt))

    def step(tokens: list[int]):
        ids = torch.tensor([tokens], device=dev)
        with capture_layers(target, aux_ids) as got:
            logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
        greedy = logits.float().argmax(dim=-1).tolist()
        aux = torch.cat([got[i][0] for i in aux_ids], dim=-1) if aux_ids else None
        return greedy, aux

    def commit(new: list[int]) -> bool:
        for t in new:
            out.append(t)
            seq.append(t)
            if t in stop or len(out) >= limit:
                return True
        return False

    if draft is not None:
        draft.reset()
    greedy, aux = step(seq)  # prefill
    finished = limit <= 0 or commit(greedy[-1:])
    pending = (torch.tensor(seq[1:], device=dev), aux, 0)  # draft inputs for positions 0..len(prompt)-1
    while not finished:
        s = len(seq)  # the target has computed positions 0..s-2; seq[-1] is the token just sampled
        # vLLM caps the scheduled tokens at max_model_len: 1 + spec <= max_model_len - (s - 1) - 1
        n_spec = min(k, max_model_len - s - 1) if draft is not None else 0
        if n_spec <= 0:
            greedy, aux = step(seq[-1:])
            finished = commit(greedy[-1:])
            continue
        ids, feats, start = pending
        proposal = draft.propose(ids, feats, start, n_spec)
        if proposals is not None:
            proposals.append(proposal)
        greedy, aux = step([seq[-1]] + proposal)
        a = 0
        while a < n_spec and proposal[a] == greedy[a]:
            a += 1
        _count(stats, n_spec, a)
        new = proposal[:a] + [greedy[a]]
        _crop(cache, s + a)  # keep positions 0..s-1+a: the last token and the accepted drafts
        finished = commit(new)
        # the draft's next pass: positions s-1..s-1+a paired with tokens s..s+a (the accepted + the new one)
        pending = (torch.tensor(new, device=dev), aux[: a + 1], s - 1)
    return out


def _left_pad(rows: list[list[int]], dev: torch.device, pad: int = 0):
    """Ragged rows -> (ids [B, W], valid [B, W] bool), right-aligned (left padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            valid[i, width - len(r):] = True
    return ids.to(dev), valid.to(dev)


class _TargetBatch:
    """The target's shared DynamicCache for B rows. Every step appends the same number of columns to
    every row; `mask` [B, cache columns] (the 2-D attention mask) says which are real: left padding
    of the prompts, draft tokens the verification rejected ("holes") and unused draft slots are 0.
    Positions are passed explicitly, so RoPE sees each row's real positions despite the holes."""

    def __init__(self, target, aux_ids: list[int], batch: int, dev: torch.device):
        from transformers import DynamicCache

        self.target, self.aux_ids = target, aux_ids
        self.cache = DynamicCache()
        self.mask = torch.zeros((batch, 0), dtype=torch.bool, device=dev)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """Run ids [B, T] at positions [B, T]; valid [B, T] marks the real ones among them.
        -> (greedy next tokens [B, T], aux hidden states [B, T, n_aux * H] or None)."""
        self.mask = torch.cat([self.mask, valid], dim=1)
        with capture_layers(self.target, self.aux_ids) as got:
            logits = self.target(input_ids=ids, attention_mask=self.mask.long(), position_ids=positions,
                                 past_key_values=self.cache, use_cache=True).logits
        greedy = logits.float().argmax(dim=-1)
        aux = torch.cat([got[i] for i in self.aux_ids], dim=-1) if self.aux_ids else None
        return greedy, aux

    def keep_last(self, keep: torch.Tensor) -> None:
        """Of the columns the last step appended, keep [B, T] (False: rejected drafts become holes)."""
        t = keep.shape[1]
        self.mask[:, -t:] &= keep

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]


@torch.inference_mode()
def decode_batch(target, prompts: list[list[int]], *, max_tokens: int, max_model_len: int, stop: set[int],
                 draft: Eagle3Draft | None = None, k: int = 0, stats: dict | None = None,
                 proposals: list[list] | None = None) -> list[list[int]]:
    """decode() for several prompts at once: the same output per prompt and the same counters (summed),
    with one target forward and one draft chain per verification step for the whole batch. Rows
    that finish leave the batch (index selection of both caches). `proposals`, if given, gets one
    list per prompt of its verified proposals (as decode's)."""
    dev = next(target.parameters()).device
    aux_ids = draft.aux_ids if draft is not None else []
    n_rows = len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    if proposals is not None:
        proposals[:] = [[] for _ in prompts]
    limits = [min(max_tokens, max_model_len - len(p)) for p in prompts]
    rows = list(range(n_rows))  # prompt index of each batch row

    def commit(i: int, new: list[int]) -> bool:
        for t in new:
            outs[i].append(t)
            if t in stop or len(outs[i]) >= limits[i]:
                return True
        return False

    tgt = _TargetBatch(target, aux_ids, n_rows, dev)
    dcache = DraftBatchCache(draft.num_layers, n_rows, dev) if draft is not None else None
    ids, valid = _left_pad(prompts, dev)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding at position 0, masked anyway
    greedy, aux = tgt.step(ids, positions, valid)  # prefill
    last = greedy[:, -1]
    done = [limits[i] <= 0 or commit(i, [int(last[r])]) for r, i in enumerate(rows)]
    # the draft's first feed: tokens 1..L (the last one just sampled) with the target's aux states at
    # positions 0..L-1; the left padding carries over (valid = the prompt's mask)
    pending = (torch.cat([ids[:, 1:], last[:, None]], dim=1), aux, positions, valid)

    while not all(done):
        if any(done):  # finished rows leave the batch: index-select every per-row tensor
            keep = [r for r, d in enumerate(done) if not d]
            sel = torch.tensor(keep, device=dev)
            tgt.select(sel)
            if dcache is not None:
                dcache.select(sel)
            last = last[sel]
            pending = tuple(x if x is None else x[sel] for x in pending)
            rows, done = [rows[r] for r in keep], [False] * len(keep)
        s = torch.tensor([len(prompts[i]) + len(outs[i]) for i in rows], device=dev)  # len(seq) per row
        # vLLM caps the scheduled tokens at max_model_len, per row: n_spec <= max_model_len - s - 1
        n_spec = (max_model_len - s - 1).clamp(min=0, max=k) if draft is not None else torch.zeros_like(s)
        n = int(n_spec.max())  # draft slots of this step; rows with fewer mask the rest
        if n > 0:
            proposal = draft.propose_batch(dcache, *pending, n)
        else:
            proposal = torch.zeros((len(rows), 0), dtype=torch.long, device=dev)
        greedy, aux, acc = _verify(tgt, last, proposal, s, n_spec)
        last = greedy.gather(1, acc[:, None])[:, 0]  # correction or bonus token
        acc_l, last_l, n_spec_l, prop_l = acc.tolist(), last.tolist(), n_spec.tolist(), proposal.tolist()
        for r, i in enumerate(rows):
            if n_spec_l[r] > 0:  # a row without room for drafts made none (n_spec = 0 in decode)
                _count(stats, n_spec_l[r], acc_l[r])
                if proposals is not None:
                    proposals[i].append(prop_l[r][: n_spec_l[r]])
            done[r] = commit(i, prop_l[r][: acc_l[r]] + [last_l[r]])
        if draft is not None:
            pending = _draft_feed(proposal, last, acc, aux, s)
    return outs


def _verify(tgt: _TargetBatch, last: torch.Tensor, proposal: torch.Tensor, s: torch.Tensor,
            n_spec: torch.Tensor):
    """One target step over [last token, n drafts] per row -> (greedy [B, 1+n], aux, accepted [B]).
    The rejected drafts stay in the cache as holes (mask 0)."""
    n = proposal.shape[1]
    cols = torch.arange(1 + n, device=proposal.device)
    greedy, aux = tgt.step(torch.cat([last[:, None], proposal], dim=1),
                           (s - 1)[:, None] + cols,        # real positions s-1 .. s-1+n
                           cols[None] <= n_spec[:, None])  # mask: a row's unused draft slots are 0
    # accepted prefix per row: drafts equal to the target's argmax, within the row's n_spec
    match = (proposal == greedy[:, :n]) & (cols[None, :n] < n_spec[:, None])
    acc = match.long().cumprod(dim=1).sum(dim=1)
    tgt.keep_last(cols[None] <= acc[:, None])  # mask: keep the last token + accepted drafts only
    return greedy, aux, acc


def _count(stats: dict, n_spec: int, accepted: int) -> None:
    """One verified draft of one row, as decode() counts it (module doc)."""
    stats["drafts"] += 1
    stats["draft_tokens"] += n_spec
    stats["accepted_tokens"] += accepted
    for j in range(accepted):
        stats["accepted_per_pos"][j] += 1


def _draft_feed(proposal: torch.Tensor, last: torch.Tensor, acc: torch.Tensor, aux: torch.Tensor,
                s: torch.Tensor):
    """The draft's next feed after a verification step, left-padded to the longest row: row r feeds
    the acc[r] + 1 pairs (token at position s-1+j+1, target aux at s-1+j), j = 0..acc[r], i.e. the
    accepted drafts and the new token with the aux states of the positions before them."""
    # step column j < acc: accepted draft j; column acc: the new token (later columns are unused)
    step_tokens = torch.cat([proposal, torch.zeros_like(last)[:, None]], dim=1)
    step_tokens.scatter_(1, acc[:, None], last[:, None])
    m = int(acc.max()) + 1
    j = torch.arange(m, device=proposal.device)
    pad = (m - 1 - acc)[:, None]  # left padding of row r: the longest feed minus its own (acc + 1)
    valid = j[None] >= pad
    src = (j[None] - pad).clamp(min=0)  # feed column -> step column (padding repeats column 0)
    tok = step_tokens.gather(1, src)
    feats = aux.gather(1, src[:, :, None].expand(-1, -1, aux.shape[-1]))
    positions = (s - 1)[:, None] + src
    return tok, feats, positions, valid


def main(request_path: str, result_path: str) -> None:
    from ..env import setup_env

    setup_env()
    from transformers import AutoTokenizer

    req = json.loads(Path(request_path).read_text())
    dev = device()
    if dev.type == "cpu":
        # Decoding one sequence is a stream of small ops: on a busy 2-core host, 2 OpenMP threads
        # wait on each other at every op (measured 5-9x slower than 1 thread here).
        torch.set_num_threads(int(os.environ.get("HF_SPEC_EVAL_CPU_THREADS", "1")))
    dtype = getattr(torch, req["dtype"])
    torch.manual_seed(req.get("seed", 0))
    spec = req.get("speculative_config") or None
    t0 = time.time()
    target = load_target(req["model"], req["dtype"], req.get("trust_remote_code", False), dev)
    tok = AutoTokenizer.from_pretrained(req["model"], trust_remote_code=req.get("trust_remote_code", False))
    stop = stop_token_ids(req["model"], tok, target)
    draft, k = None, 0
    if spec:
        if spec.get("method") != "eagle3":
            raise SystemExit(f"hf_spec_eval: unsupported speculative method {spec.get('method')!r} (eagle3 only)")
        k = int(spec["num_speculative_tokens"])
        draft = Eagle3Draft(spec["model"], target, dtype, dev)
        print(f"[hf_spec_eval] draft {spec['model']}: aux layers {draft.aux_ids}, K={k}, "
              f"norm_output={draft.norm_output}, draft vocab {draft.lm_head.shape[0]}", flush=True)
    startup = time.time() - t0
    print(f"[hf_spec_eval] {req['model']} on {dev} ({req['dtype']}), startup {startup:.1f}s", flush=True)
    kw = dict(max_model_len=req["max_model_len"], stop=stop, draft=draft, k=k)
    warm = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * k}
    batch = int(req.get("batch_size", 1))
    if batch < 1:
        raise SystemExit(f"hf_spec_eval: batch_size must be >= 1, not {batch}")
    prompts = req["prompts"]
    if batch == 1:
        decode(target, prompts[0], max_tokens=4, stats=warm, **kw)  # warm-up, not counted (as vllm_eval)
    else:
        decode_batch(target, prompts[:batch], max_tokens=4, stats=warm, **kw)
    stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * k}
    outputs = []
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.time()
    from tqdm import tqdm

    if batch == 1:
        for p in tqdm(prompts, unit="prompt", desc="hf_spec_eval"):
            outputs.append(decode(target, p, max_tokens=req["max_tokens"], stats=stats, **kw))
    else:  # consecutive chunks of the request's prompts, in order
        for i in tqdm(range(0, len(prompts), batch), unit="batch", desc=f"hf_spec_eval (batch {batch})"):
            outputs += decode_batch(target, prompts[i: i + batch], max_tokens=req["max_tokens"], stats=stats, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t1
    result = {
        "outputs": outputs,
        "texts": [tok.decode(o, skip_special_tokens=True) for o in outputs],
        "generation_s": seconds,
        "startup_s": startup,
        "output_tokens": sum(len(o) for o in outputs),
        "spec_decode": stats if spec else {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []},
    }
    if spec:
        al = 1 + stats["accepted_tokens"] / stats["drafts"] if stats["drafts"] else 1.0
        print(f"[hf_spec_eval] drafts {stats['drafts']}, accepted {stats['accepted_tokens']}, AL {al:.3f}, "
              f"per position {stats['accepted_per_pos']}", flush=True)
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
