"""transformers ("hf") engine: generation and hidden-state extraction where vLLM is absent.

Same inputs and outputs as the vLLM engines, so the steps downstream cannot tell them apart:
  generate()    regeneration for `prepare` (data.engine = "hf"): Generation(text, token_ids, finish_reason)
                in prompt order; token_ids end with the EOS token when one was generated (as vLLM's do),
                text is decoded without special tokens.
  extract_hf()  hidden states for `extract` (extract.engine = "hf"): one file per sample,
                {"hidden_states": [T, len(layer_ids), H] (model dtype), "token_ids": int64 [T]}, layers in
                the given ascending vLLM-convention ids (id k = residual stream entering decoder layer k,
                id N = output of the last decoder layer before the final norm), written to a temporary
                name and renamed, so a file is complete or absent.

Both sort the work by length and batch it (left padding for generation, right padding for
extraction), run on CUDA when available and loop over tokens only as decode steps (never per sample).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import torch

from .hf_reference import decoder_layers, resolve_device
from .vllm_offline import Generation


def device() -> torch.device:
    return resolve_device("auto")


def load_target(path, dtype: str, trust_remote_code: bool = False, dev: torch.device | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    return model.to(dev or device()).eval()


def stop_token_ids(path, tok, model=None) -> set[int]:
    """What vLLM stops on: the tokenizer's EOS plus generation_config.json's eos_token_id(s)."""
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = None
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path)).eos_token_id
    except OSError:  # no generation_config.json: transformers derives it from config.json
        gen = getattr(getattr(model, "config", None), "eos_token_id", None)
    if gen is not None:
        ids.update(int(x) for x in (gen if isinstance(gen, (list, tuple)) else [gen]))
    return ids


@contextlib.contextmanager
def capture_layers(model, layer_ids: list[int]):
    """Forward hooks that record the vLLM-convention hidden states `layer_ids` of every forward pass.

    Yields a dict that each forward fills with {id: [B, T, H]}: id 0 is the embedding output, id k > 0
    the output of decoder layer k - 1 (the residual stream entering layer k; id N is therefore the
    last layer's output before the final norm, as vLLM's aux hidden states and its extraction)."""
    layers = decoder_layers(model)
    n = len(layers)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"layer ids {bad} out of range for a {n}-layer model (vLLM convention: 0..{n})")
    store: dict[int, torch.Tensor] = {}
    handles = []

    def hook_for(lid):
        def hook(_mod, _inp, out):
            store[lid] = out[0] if isinstance(out, tuple) else out
        return hook

    try:
        for lid in layer_ids:
            mod = model.get_input_embeddings() if lid == 0 else layers[lid - 1]
            handles.append(mod.register_forward_hook(hook_for(lid)))
        yield store
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# generation


def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


# The decode step's attention. transformers' sdpa path expands the keys and values of a grouped-query model
# (SmolLM2: 9 query heads on 3 kv heads) to every query head (repeat_kv) whenever a padding mask is given, so each
# step of a batch of left-padded prompts copied the whole cache three times, on top of the DynamicCache appending
# to it. Decoding from a preallocated StaticCache with the query heads of each kv head laid out as one query row
# each (an exact rewrite: one query token attends to the same keys in every head) reads the cache once per step.
GQA_DECODE = "eagle3_factory_gqa_decode"


def _gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "s_aux", "softcap"))
    if q_len != 1 or hq == hkv or extras:  # the prefill, no grouped heads, or terms SDPA alone lacks: sdpa as is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # query head h uses kv head h // (hq // hkv) (repeat_kv's order): [B, hq, 1, D] -> [B, hkv, hq // hkv, D]
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, hq // hkv, d), key, value,
                                                           attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _decode_attention(model):
    """The model's attention set to `_gqa_decode_attention` (registered once) for the duration; restored after."""
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_DECODE, _gqa_decode_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(GQA_DECODE)
    try:
        if model.config._attn_implementation != GQA_DECODE:  # eager attention would add the boolean masks
            raise RuntimeError(f"{type(model).__name__} did not take the {GQA_DECODE} attention")
        yield
    finally:
        model.set_attn_implementation(before)


def _left_padded(prompts: list[list[int]], pad_id: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, width] token ids, left-padded with pad_id, and the [B, width] boolean mask of the real tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), width), dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        real[r, width - len(p):] = True
    return ids.to(dev), real.to(dev)


def _static_decode_ok(model) -> bool:
    """The StaticCache + 4-D mask path needs a transformers-native model whose every layer attends to the whole
    context: the masks built here know nothing of sliding windows or chunked attention, and remote code may not
    dispatch through transformers' attention functions. Other models keep transformers' own masks and cache."""
    if not (type(model).__module__.startswith("transformers.") and getattr(model, "_supports_attention_backend", False)):
        return False
    try:  # the layer types as StaticCache itself decides them (a set sliding_window or attention_chunk_size counts)
        from transformers.cache_utils import get_layer_types_and_kwargs

        types = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]
    except (ImportError, AttributeError, TypeError):
        return False
    return all(t == "full_attention" for t in types)


_GRAPH_FAILED: list[str] = []  # why a capture failed in this process (then every batch decodes eagerly)


def _next_logits(model, ids, mask, pos, cache):
    """One forward of the decode loops (prefill or one token) -> the logits of each row's last position."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                 logits_to_keep=1).logits[:, -1]


class _DecodeGraph:
    """The one-token decode step of `generate_batch` as a CUDA graph over its StaticCache.

    The inputs (token ids, positions, the 4-D mask) are copied into static tensors and the captured forward is
    replayed; the cache's layers advance their own device-side lengths inside the graph, as they do eagerly. One
    eager warm-up runs the first decode step on a side stream (capture needs it), which writes that step's keys and
    values where the first replay writes the same ones; the layers' lengths are put back after it. The warm-up
    runs with torch's sync debug mode at "error", so a forward that waits on the GPU (`.item()`, a branch on a
    tensor: dynamic RoPE, MoE routing) raises there, before a capture starts: a capture that fails midway leaves
    torch's allocator unusable for the rest of the process."""

    def __init__(self, model, cache, ids, pos, mask):
        self.ids, self.pos, self.mask = ids.clone(), pos.clone(), mask.clone()
        lengths = [(layer, layer.cumulative_length.clone()) for layer in cache.layers]
        run = functools.partial(_next_logits, model, self.ids, self.mask, self.pos, cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        mode = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.stream(side):
                run()
        finally:  # the warm-up advanced the layers' lengths (or failed partway): back to this step's position
            torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.current_stream().wait_stream(side)
            for layer, n in lengths:
                layer.cumulative_length.copy_(n)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()

    def __call__(self, ids, pos, mask):
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.mask.copy_(mask)
        self.graph.replay()
        return self.logits


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop: set[int],
                   gen: torch.Generator | None = None, pad_id: int = 0, check_every: int = 16,
                   cuda_graph: bool = True) -> list[tuple[list[int], str]]:
    """One left-padded batch: (token ids, finish reason) per prompt. EOS stops a row (and is kept).

    The cache is a StaticCache of prompt width + max_new_tokens; the masks are built here as 4-D booleans
    (transformers passes a 4-D mask through as it is): key j is visible to position i when j <= i and j is not
    padding (a padding position sees itself only, so no row of the softmax is empty). A model this cannot serve
    (`_static_decode_ok`) decodes with a DynamicCache and transformers' own masks from the 2-D padding mask.

    check_every: the steps between two looks at whether every row has stopped (each look waits for the GPU; rows
    that stopped decode padding until then, which changes no greedy output; when sampling, those extra steps draw
    from the generator the batches share, so later batches sample other tokens than at check_every=1, from the
    same distribution and reproducibly). cuda_graph: on CUDA, the one-token decode step is captured once per batch
    as a CUDA graph and replayed (the prefill stays eager); after a capture fails, decoding stays eager for the
    rest of the process (`_DecodeGraph`). Both cut the host's
    share of a step: on an H100, 1,024 prompts of width 128 decoded at 28.3 ms a step with neither and 10.6 ms
    with both, the same token ids (NOTES "Session 40"; tests/bench/regen_throughput.py --variants)."""
    from transformers import StaticCache

    if not _static_decode_ok(model):
        return _generate_batch_dynamic(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                       stop=stop, gen=gen, pad_id=pad_id)
    dev = next(model.parameters()).device
    ids, prompt_real = _left_padded(prompts, pad_id, dev)
    b, width = ids.shape
    total = width + max_new_tokens
    real = torch.cat([prompt_real, torch.ones((b, max_new_tokens), dtype=torch.bool, device=dev)], dim=1)
    pos = (real[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    at = torch.arange(total, device=dev)
    prefill_mask = ((at[None, :] <= at[:width, None])[None] & real[:, None, :]) | (at[None, :] == at[:width, None])[None]
    mask = prefill_mask[:, None]                       # [B, 1, width, total]
    stop_t = torch.tensor(sorted(stop) or [-1], device=dev)
    cache = StaticCache(config=model.config, max_cache_len=total)
    out = torch.empty((b, max_new_tokens), dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    ends = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)  # output length per row
    steps = 0
    graphed, use_graph = None, cuda_graph and dev.type == "cuda" and not _GRAPH_FAILED
    with _decode_attention(model):
        for step in range(max_new_tokens):
            if step > 0 and use_graph and graphed is None:
                try:
                    graphed = _DecodeGraph(model, cache, ids, pos, mask)
                except torch.OutOfMemoryError:
                    raise
                except (RuntimeError, AttributeError) as e:  # a model or transformers the capture fails on
                    use_graph = False
                    _GRAPH_FAILED.append(f"{type(e).__name__}: {str(e)[:200]}")
                    print(f"[generate] the CUDA graph of the decode step failed ({_GRAPH_FAILED[0]}); decoding "
                          f"eagerly from here on", flush=True)
            if step > 0 and use_graph:
                logits = graphed(ids, pos, mask)
            else:
                logits = _next_logits(model, ids, mask, pos, cache)
            nxt = _sample(logits, temperature, gen)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            out[:, step] = nxt
            steps = step + 1
            hit = torch.isin(nxt, stop_t) & ~done
            ends = torch.where(hit, torch.full_like(ends, step + 1), ends)
            done |= hit
            if (step + 1) % max(check_every, 1) == 0 and bool(done.all()):
                break
            ids = nxt[:, None]
            pos = pos[:, -1:] + 1
            mask = (real & (at <= width + step))[:, None, None, :]
    out_l, ends_l, done_l = out[:, :steps].tolist(), ends.tolist(), done.tolist()
    return [(row[:e], "stop" if d else "length") for row, e, d in zip(out_l, ends_l, done_l)]


def _generate_batch_dynamic(model, prompts, *, max_new_tokens, temperature, stop, gen, pad_id):
    """generate_batch for models with sliding-window/chunked layers or remote code: transformers' masks and cache."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids, real = _left_padded(prompts, pad_id, dev)
    b, mask = ids.shape[0], real.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    stop_t = torch.tensor(sorted(stop) or [-1], device=dev)
    cache = DynamicCache()
    out = []
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    ends = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)
    for step in range(max_new_tokens):
        logits = _next_logits(model, ids, mask, pos, cache)
        nxt = torch.where(done, torch.full_like(done, pad_id, dtype=torch.long), _sample(logits, temperature, gen))
        out.append(nxt)
        hit = torch.isin(nxt, stop_t) & ~done
        ends = torch.where(hit, torch.full_like(ends, step + 1), ends)
        done |= hit
        if bool(done.all()):
            break
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
    out_l = torch.stack(out, 1).tolist() if out else [[] for _ in prompts]
    ends_l, done_l = ends.tolist(), done.tolist()
    return [(row[:e], "stop" if d else "length") for row, e, d in zip(out_l, ends_l, done_l)]


def generate(model_path, prompts: list[list[int]], *, dtype: str = "bfloat16", batch_size: int = 32,
             trust_remote_code: bool = False, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             progress: bool = True, on_batch=None) -> list[Generation]:
    """Batched generation with the target in transformers: greedy (temperature 0, deterministic) or
    pure temperature sampling (no top-k/top-p, as vLLM's SamplingParams(temperature=...)).

    Prompts are sorted by length (longest first, so a batch that does not fit fails at once) and
    generated `batch_size` at a time with left padding; results come back in prompt order. A batch that runs
    out of GPU memory is retried at half the size, and the rest goes on at that size (session 35: the H200
    config's 2,048 ran out of memory on an H100 answering MT-bench-style requests); at a batch of one the error
    is raised."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if not prompts:
        return []
    model = load_target(model_path, dtype, trust_remote_code)
    tok = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    stop = stop_token_ids(model_path, tok, model)
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Generation | None] = [None] * len(prompts)
    size, start = max(batch_size, 1), 0
    with tqdm(total=len(prompts), unit="prompt", desc="generate (hf)", disable=not progress) as bar:
        while start < len(order):
            idx = order[start: start + size]
            try:
                outs = generate_batch(model, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                                      temperature=temperature, stop=stop, gen=gen, pad_id=pad_id)
            except torch.OutOfMemoryError:
                if len(idx) == 1:
                    raise
                outs = None  # retried below, outside the handler, so the failed batch's tensors can be freed
            if outs is None:
                size = max(len(idx) // 2, 1)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                tqdm.write(f"[generate] a batch of {len(idx)} prompts ran out of GPU memory; going on at {size} "
                           f"(set data.batch_size={size} to start there)")
                continue
            start += len(idx)
            for i, (ids, reason) in zip(idx, outs):
                results[i] = Generation(tok.decode(ids, skip_special_tokens=True), ids, reason)
            if on_batch is not None:  # lets the caller persist finished work (prepare resumes from it)
                on_batch(idx, [results[i] for i in idx])
            bar.update(len(idx))
    del model
    return results  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# extraction


def token_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices sorted by length (longest first), cut into batches whose padded size
    (count x longest) stays within `token_budget` (a sample longer than the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@torch.inference_mode()
def hidden_states_batch(model, seqs: list[list[int]], layer_ids: list[int], pad_id: int = 0) -> list[torch.Tensor]:
    """[T_i, len(layer_ids), H] per sequence from one right-padded forward pass (model dtype)."""
    dev = next(model.parameters()).device
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    with capture_layers(model, layer_ids) as got:
        model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False, logits_to_keep=1)
    stacked = torch.stack([got[lid] for lid in layer_ids], dim=2)  # [B, W, L, H]
    return [stacked[r, : len(s)] for r, s in enumerate(seqs)]


def extract_hf(cfg, todo: list[tuple[str, int, list[int]]], out: Path, layer_ids: list[int], hidden: int) -> dict:
    """Hidden states of `todo` samples into out/<split>/hs_<index>.safetensors (see module doc).

    Batches hold up to extract.batch_size x data.seq_length padded tokens, longest samples first."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..hidden_states import check_header, file_name
    from ..manifest import StepError

    if not todo:
        return {"extract_s": 0.0, "tokens_extracted": 0}
    model = load_target(cfg.model_path, cfg.model.dtype, cfg.model.trust_remote_code)
    dtype = getattr(torch, cfg.model.dtype)
    budget = max(cfg.extract.batch_size, 1) * max(cfg.data.seq_length, max(len(t[2]) for t in todo))
    batches = token_batches([len(t[2]) for t in todo], budget)
    print(f"[extract] hf engine on {device()}: {len(todo)} samples in {len(batches)} batches "
          f"(<= {budget} padded tokens each), {cfg.model.dtype}")
    tokens = 0
    t0 = time.time()
    with tqdm(total=sum(len(t[2]) for t in todo), unit="tok", desc="extract (hf)") as bar:
        for batch in batches:
            items = [todo[i] for i in batch]
            states = hidden_states_batch(model, [ids for _, _, ids in items], layer_ids)
            for (split, i, ids), hs in zip(items, states):
                final = out / split / file_name(i)
                tmp = final.with_name(f".{final.name}.tmp")
                try:
                    save_file({"hidden_states": hs.to(dtype).contiguous().cpu(),
                               "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(tmp))
                    reason = check_header(tmp, len(ids), len(layer_ids), hidden)
                    if reason:
                        raise StepError(f"sample {split}/{i}: the hf engine wrote a wrong file: {reason}")
                    os.replace(tmp, final)
                finally:
                    tmp.unlink(missing_ok=True)
                tokens += len(ids)
                bar.update(len(ids))
    seconds = time.time() - t0
    del model
    return {"extract_s": round(seconds, 1), "tokens_extracted": tokens}
