"""Chat-template tokenization with assistant-only loss masks.

The template is rendered by the target's own tokenizer. Assistant spans are found by rendering
prefixes: the text of messages[:i] with the generation prompt ends where assistant message i starts,
and the text of messages[:i+1] ends where it stops (its end-of-turn marker included, so the drafter
learns to end turns). The template must render prefixes consistently; if it does not, the
conversation is rejected with a reason instead of being masked wrongly.

Works for any role-marker format the template renders, e.g. Llama/ChatML or Kimi-K2
(`<|im_user|>user<|im_middle|>...<|im_end|>`), including `tool` messages (never trained) and
assistant `tool_calls` (trained: the drafter must predict them), with `tools` passed to the template.

Reasoning ("thinking") content of assistant messages, given as `reasoning_content` (or `reasoning`)
or as a leading `<think>...</think>` block in `content`, is handled by a mode:
  keep        reasoning rendered and trained
  drop        reasoning removed before rendering (the template may still render empty think tags)
  final_only  reasoning rendered (the target sees it) but masked out: only the final answer, tool
              calls and end-of-turn marker are trained
Reasoning goes to the template as `reasoning_content` when the template renders that field (Kimi,
DeepSeek-R1/Qwen3-style templates); otherwise it is put back in `content` as `<think>...</think>`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


class TemplateError(ValueError):
    pass


REASONING_MODES = ("keep", "drop", "final_only")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
_PROBE = "R3as0ning-Pr0be"


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def assistant_tokens(self) -> int:
        return sum(self.loss_mask)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a prompt that asks for the next assistant answer (generation prompt appended)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def prompt_ids_batch(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """prompt_ids for many prompts in one call: the template renders each, and a fast tokenizer encodes the batch in
    parallel (prepare's regeneration rounds: one by one ~1 ms a prompt on this 2-core machine, about a minute for
    the 53k of session 18's mix; tests/bench/prompt_tokenization.py). Equal to prompt_ids element by element
    (tests/test_datasets.py)."""
    if not prompts:
        return []
    out = tokenizer.apply_chat_template(prompts, tokenize=True, add_generation_prompt=True)
    return out if isinstance(out, list) else out["input_ids"]


def template_renders_reasoning(tokenizer) -> bool:
    """Whether the chat template renders an assistant message's `reasoning_content` field."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": _PROBE}]
    try:
        return _PROBE in render(tokenizer, msgs)
    except Exception:  # noqa: BLE001 - a template that chokes on the field does not support it
        return False


def split_reasoning(message: dict) -> tuple[str | None, dict]:
    """(reasoning or None, the message without it) for an assistant message."""
    m = dict(message)
    reasoning = m.pop("reasoning_content", None)
    if reasoning is None:
        reasoning = m.pop("reasoning", None)
    else:
        m.pop("reasoning", None)
    content = m.get("content")
    if isinstance(content, str):
        inline = _INLINE_THINK.match(content)
        if inline:
            m["content"] = content[inline.end():]
            if reasoning is None:
                reasoning = inline.group(1).strip()
    return reasoning, m


def apply_reasoning_mode(tokenizer, messages: list[dict], mode: str) -> tuple[list[dict], list[str | None]]:
    """Messages as they are rendered under `mode`, and each message's reasoning text (None = none)."""
    if mode not in REASONING_MODES:
        raise ValueError(f"reasoning mode {mode!r}; expected one of {REASONING_MODES}")
    has_reasoning = False
    out, reasons = [], []
    for m in messages:
        r = None
        if m.get("role") == "assistant":
            r, m = split_reasoning(m)
            if mode == "drop":
                r = None
            has_reasoning |= r is not None
        out.append(m)
        reasons.append(r)
    if has_reasoning:
        native = template_renders_reasoning(tokenizer)
        for m, r in zip(out, reasons):
            if r is None:
                continue
            if native:
                m["reasoning_content"] = r
            else:
                m["content"] = f"{THINK_OPEN}{r}{THINK_CLOSE}" + (m.get("content") or "")
    return out, reasons


def _final_only(full: str, start: int, end: int, reasoning: str) -> int:
    """Start of the trained part of an assistant span: just after its reasoning block."""
    at = full.find(reasoning, start, end) if reasoning else start
    if at < 0:
        raise TemplateError("chat template does not render the assistant's reasoning inside its turn")
    stop = at + len(reasoning)
    close = full.find(THINK_CLOSE, stop, end)
    if close >= 0 and full[stop:close].strip() in ("", THINK_OPEN):
        stop = close + len(THINK_CLOSE)
    elif not reasoning:
        return start  # no reasoning and no think block: the whole turn is the answer
    while stop < end and full[stop] in " \n":
        stop += 1
    return stop


def assistant_char_spans(tokenizer, messages: list[dict], tools: list | None = None,
                         reasoning: list[str | None] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character spans that are trained. With `reasoning` (per message), an
    assistant span starts after that message's think block, empty or not (mode final_only)."""
    full = render(tokenizer, messages, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        end_text = render(tokenizer, messages[: i + 1], tools=tools)
        if not (full.startswith(start_text) and full.startswith(end_text) and len(end_text) > len(start_text)):
            raise TemplateError(f"chat template does not render message {i} as a prefix of the conversation")
        start, end = len(start_text), len(end_text)
        if reasoning is not None:
            start = _final_only(full, start, end, reasoning[i] or "")
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, tools: list | None = None,
                          reasoning: str = "keep") -> Tokenized:
    """Token ids of the rendered conversation and a 0/1 mask over assistant tokens, truncated to max_length."""
    msgs, reasons = apply_reasoning_mode(tokenizer, messages, reasoning)
    full, spans = assistant_char_spans(tokenizer, msgs, tools, reasons if reasoning == "final_only" else None)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in enc["offset_mapping"]]
    else:
        ids, mask = _tokenize_by_segments(tokenizer, full, spans)
    return Tokenized(ids[:max_length], mask[:max_length])


# Below this many conversations prepare tokenizes in its own process (a worker's start, importing transformers,
# costs seconds); at or above it, on up to 16 worker processes: 1.4 ms a conversation on one core was 55 s of
# the 39k-conversation mix's prepare on 2 cores, 28 s on 2 processes (tests/bench/prepare_phases.py; session 27)
PARALLEL_FROM = 4000
_WORKER: dict = {}


def tokenize_conversations(tokenizer, items: list[tuple[list[dict], list | None]], max_length: int,
                           reasoning: str = "keep", workers: int | None = None) -> list:
    """tokenize_conversation over (messages, tools) pairs, in order: a Tokenized each, or the TemplateError that
    rejected it (returned, not raised). On `workers` spawned processes (default: one per CPU up to 16, from
    PARALLEL_FROM conversations on), each with its own copy of the tokenizer: the same results as one by one.
    Spawned workers import the caller's main module: a script that calls this (or prepare) must keep its work under
    `if __name__ == "__main__":`, as `python -m pipeline` does."""
    import os

    if workers is None:
        workers = min(os.cpu_count() or 1, 16) if len(items) >= PARALLEL_FROM else 1
    if workers <= 1 or len(items) < 2:
        return [_tokenize_or_error(tokenizer, m, t, max_length, reasoning) for m, t in items]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(items) // (workers * 4))  # a few chunks a worker, so a slow chunk does not hold the rest
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    # spawn, not fork: prepare may have run the target on the GPU (and torch's threads) in this process
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(tokenizer, max_length, reasoning)) as pool:
        return [r for part in pool.map(_worker_chunk, chunks) for r in part]


def _tokenize_or_error(tokenizer, messages, tools, max_length, reasoning):
    try:
        return tokenize_conversation(tokenizer, messages, max_length, tools=tools, reasoning=reasoning)
    except TemplateError as e:
        return e


def _worker_init(tokenizer, max_length: int, reasoning: str) -> None:
    _WORKER.update(tokenizer=tokenizer, max_length=max_length, reasoning=reasoning)


def _worker_chunk(items: list) -> list:
    w = _WORKER
    return [_tokenize_or_error(w["tokenizer"], m, t, w["max_length"], w["reasoning"]) for m, t in items]


def _tokenize_by_segments(tokenizer, full: str, spans: list[tuple[int, int]]):
    """For tokenizers without offsets (e.g. tiktoken-based): tokenize the text between span borders."""
    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(full), len(full))]:
        for text, m in ((full[pos:s], 0), (full[s:e], 1)):
            if text:
                t = tokenizer.encode(text, add_special_tokens=False)
                ids += t
                mask += [m] * len(t)
        pos = e
    if ids != tokenizer.encode(full, add_special_tokens=False):
        raise TemplateError("segment-wise tokenization differs from whole-text tokenization")
    return ids, mask
