"""Where a greedy target loops, in token ids: used by `train.mask_loops` and tests/bench/loop_share.py.

A token "repeats" when the 8-gram ending at it already occurred earlier in the same answer. An answer's terminal
loop is its longest tail of at least 32 tokens of which at least 90 % repeat: the text after the target fell into
a cycle it never leaves (51.5 % of the 135M target's regenerated answers end in one, 45 % of their tokens; NOTES,
"Drafter quality", session 10). An answer is a run of loss-mask 1s in a prepared sample.
"""
from __future__ import annotations

NGRAM, MIN_LOOP, DENSITY = 8, 32, 0.9


def repeat_flags(ids: list[int], n: int = NGRAM) -> list[bool]:
    """For each token: does the n-gram ending at it occur earlier in ids?"""
    seen, flags = set(), [False] * len(ids)
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i:i + n])
        flags[i + n - 1] = g in seen
        seen.add(g)
    return flags


def terminal_loop(ids: list[int], min_len: int = MIN_LOOP, dense: float = DENSITY) -> int:
    """Length of the answer's terminal loop: the longest tail (>= min_len tokens) of which >= dense repeat an
    earlier n-gram; 0 when there is none."""
    rep, best = 0, 0
    for k, repeated in enumerate(reversed(repeat_flags(ids)), 1):  # tails of length k, from the end
        rep += repeated
        if k >= min_len and rep >= dense * k:
            best = k
    return best


def answer_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    spans, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def mask_terminal_loops(input_ids: list[int], loss_mask: list[int]) -> tuple[list[int], int]:
    """The loss mask with every answer's terminal loop set to 0, and how many tokens that took out. The tokens
    stay in the sample (the draft still sees them as context); only the loss on them goes."""
    out = [int(m) for m in loss_mask]
    masked = 0
    for s, e in answer_spans(out):
        k = terminal_loop(list(input_ids[s:e]))
        out[e - k:e] = [0] * k
        masked += k
    return out, masked
