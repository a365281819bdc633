"""Chat-template tokenization with assistant-only loss masks.

The template is rendered by the target's own tokenizer. Assistant spans are found by rendering
prefixes: the text of messages[:i] with the generation prompt ends where assistant message i starts,
and the text of messages[:i+1] ends where it stops (its end-of-turn marker included, so the drafter
learns to end turns). The template must render prefixes consistently; if it does not, the
conversation is rejected with a reason instead of being masked wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    pass


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def assistant_tokens(self) -> int:
        return sum(self.loss_mask)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(tokenizer, messages[:i], add_generation_prompt=True)
        end_text = render(tokenizer, messages[: i + 1])
        if not (full.startswith(start_text) and full.startswith(end_text) and len(end_text) > len(start_text)):
            raise TemplateError(f"chat template does not render message {i} as a prefix of the conversation")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Tokenized:
    """Token ids of the rendered conversation and a 0/1 mask over assistant tokens, truncated to max_length."""
    full, spans = assistant_char_spans(tokenizer, messages)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in enc["offset_mapping"]]
    else:
        ids, mask = _tokenize_by_segments(tokenizer, full, spans)
    return Tokenized(ids[:max_length], mask[:max_length])


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
