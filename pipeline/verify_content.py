"""Content checks that every hidden-state file passes (verify's second half; pipeline/verify.py runs them).

A sampled parity check finds a fault that hits one file in n with probability k/n. These checks read the
values of *every* file and hold them to what the target itself says, cheaply:

- zero-rows     no token row of any layer is all zeros (a zeroed or unwritten tail, a short copy).
- prefix-parity the first `verify.prefix_tokens` positions of every file against a transformers forward pass
                over those tokens only (causal: their states do not depend on what follows; not so for rotary
                scalings that depend on the sequence length, e.g. dynamic NTK, where long files may differ). Per layer the
                mean per-token cosine must reach verify.prefix_min_cosine, and the norm ratio stay within
                verify.max_norm_deviation (median over layers; norm_problems). Catches swapped or shifted
                layers, rescaled values and rolled positions in any file. Batched over files, and files that
                begin alike (a chat template's system prompt) share one reference forward.
- head          the target's final norm and output head applied to the last captured layer (id N, the final
                pre-norm state) at `verify.head_positions` seeded positions per file (answer positions where
                the prepared loss mask has them): the prepared next token must be in the head's top 5 as often
                as on clean data. The clean rate is calibrated on the parity sample (files that passed the full
                parity); a file below verify.head_fraction (0.5) of the lowest clean rate is flagged, and
                verify then runs the full parity on it: wrong states fail, right states for tokens the target
                would not produce are a warning. Catches states of another sample, positions shifted, truncated
                or zeroed parts. Skipped (said so) when N is not captured or the head does not predict the data
                (median clean rate below 0.3, e.g. random weights on human text).
- duplicate     no two files hold the same hidden states for different token ids (one request's output
                returned twice).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import torch

LAYER_NORM_FACTOR = 5     # one layer alone may deviate this many times verify.max_norm_deviation (final-layer noise)
TOP_K = 5                 # head check: the prepared next token must be among the head's top-k
MIN_INFORMATIVE = 0.3     # lowest clean per-file top-k rate at which the head check can tell clean from corrupt
PREFIX_BATCH = 16         # files per batched prefix forward pass
HEAD_BATCH = 16           # files per batched head product


@dataclass
class Finding:
    check: str
    reason: str


@dataclass
class FileFacts:
    """What the checks need from every value of one file, without the model: reader threads make them beside the
    main thread's batched model work (sha256 and numpy's kernels release the GIL)."""
    digest: str                      # sha256 of the states' bytes (duplicate)
    zero_rows: torch.Tensor | None   # [T, L] bool, None when no row is all zeros (zero-rows)


# float dtype -> (integer view, exponent bits, magnitude bits): a value is not finite when all its exponent bits
# are set, and zero (+0 or -0) when no magnitude bit is
FLOAT_BITS = {torch.bfloat16: (torch.int16, 0x7F80, 0x7FFF), torch.float16: (torch.int16, 0x7C00, 0x7FFF),
              torch.float32: (torch.int32, 0x7F800000, 0x7FFFFFFF)}


def bits(hs: torch.Tensor):
    """(numpy integer view of the values, exponent mask, magnitude mask). numpy's kernels run on the calling thread
    (torch's would each start a team of OpenMP threads: oversubscribed under verify's reader threads)."""
    view, exponent, magnitude = FLOAT_BITS[hs.dtype]
    return hs.contiguous().view(view).numpy(), exponent, magnitude


def all_finite(hs: torch.Tensor) -> bool:
    if hs.dtype not in FLOAT_BITS:
        return bool(torch.isfinite(hs).all())
    b, exponent, _ = bits(hs)
    return not ((b & exponent) == exponent).any()


def file_facts(hs: torch.Tensor) -> FileFacts:
    if hs.dtype in FLOAT_BITS:
        b, _, magnitude = bits(hs)
        zero = torch.from_numpy(((b & magnitude) == 0).all(axis=-1))  # [T, L]
    else:
        zero = (hs == 0).all(dim=-1)
    digest = hashlib.sha256(hs.contiguous().view(torch.int16 if hs.element_size() == 2 else torch.int32)
                            .numpy()).hexdigest()  # the buffer itself: no copy of the bytes
    return FileFacts(digest, zero if zero.any() else None)


@dataclass
class ContentChecks:
    """Feed every readable file with `add`, then `finish`; findings per file name, and a summary per check."""

    model: object
    layer_ids: list[int]
    num_layers: int
    prefix_tokens: int
    head_positions: int
    min_cosine: float          # prefix-parity's (verify.prefix_min_cosine)
    max_norm_deviation: float
    seed: int
    head_fraction: float = 0.5  # verify.head_fraction
    findings: dict[str, list[Finding]] = field(default_factory=dict)
    _prefix_queue: dict[int, list] = field(default_factory=dict)
    _prefix_stats: list[dict] = field(default_factory=list)
    _prefix_refs: dict[tuple, torch.Tensor] = field(default_factory=dict)  # reference per distinct prefix
    _prefix_forwards: int = 0
    _head_queue: list = field(default_factory=list)
    _head_rates: dict[str, tuple[int, int]] = field(default_factory=dict)
    _calibration: dict[str, float] = field(default_factory=dict)
    _hashes: dict[str, list[tuple[str, tuple]]] = field(default_factory=dict)
    _zero_files: int = 0
    _tokens: int = 0

    def __post_init__(self):
        from .engines.hf_reference import final_norm_and_head

        self.head_ok, self._why = True, None
        if self.layer_ids[-1] != self.num_layers:
            self.head_ok, self._why = False, (f"the last captured layer id {self.layer_ids[-1]} is not the final "
                                              f"pre-norm state (id {self.num_layers}); the head cannot read it")
        elif self.head_positions <= 0:
            self.head_ok, self._why = False, "verify.head_positions = 0 turns it off"
        else:
            norm, head = final_norm_and_head(self.model)
            if norm is None:
                self.head_ok, self._why = False, "the target's final norm or output head was not found"
            else:
                self._norm, self._head_w = norm, head.weight.detach()
        self._dtype = next(self.model.parameters()).dtype

    # ---- per file -------------------------------------------------------------------------------
    def add(self, name: str, hs: torch.Tensor, ids: list[int], mask: list[int] | None, calibrate: bool,
            facts: FileFacts | None = None) -> None:
        """hs: [T, L, H] as read from the file (token ids already checked equal to `ids`); facts: file_facts(hs),
        when a reader thread computed them already."""
        facts = facts or file_facts(hs)
        self._tokens += len(ids)
        self._zero_rows(name, facts.zero_rows)
        self._hashes.setdefault(facts.digest, []).append((name, tuple(ids)))
        if self.head_ok:
            eligible = _eligible_positions(len(ids), mask)
            if len(eligible) >= 8:
                rng = random.Random(f"{self.seed}/{name}")
                picked = sorted(rng.sample(eligible, min(self.head_positions, len(eligible))))
                self._head_queue.append((name, hs[picked, -1].clone(), [ids[t + 1] for t in picked]))
                if len(self._head_queue) >= HEAD_BATCH:
                    self._flush_head()
                if calibrate:  # the file's clean rate, on up to 8x the positions the check samples
                    more = sorted(rng.sample(eligible, min(8 * self.head_positions, len(eligible))))
                    hits = self._head_hits(hs[more, -1], [ids[t + 1] for t in more])
                    self._calibration[name] = int(hits.sum()) / len(more)
        p = min(self.prefix_tokens, len(ids))
        if p > 0:
            queue = self._prefix_queue.setdefault(p, [])
            queue.append((name, ids[:p], hs[:p].clone()))
            if len(queue) >= PREFIX_BATCH:
                self._flush_prefix(p)

    def _zero_rows(self, name: str, zero: torch.Tensor | None) -> None:
        if zero is None:
            return
        self._zero_files += 1
        for j, lid in enumerate(self.layer_ids):
            rows = zero[:, j].nonzero().flatten().tolist()
            if rows:
                self._find(name, "zero-rows", f"layer id {lid}: {len(rows)} all-zero token rows "
                           f"(positions {rows[0]}..{rows[-1]} of {len(zero)}): an unwritten or zeroed part")

    @torch.no_grad()
    def _head_hits(self, states: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """[n] bool: the next token is among the head's top-k for each final pre-norm state [n, H]."""
        logits = self._norm(states.to(self._head_w.device, self._dtype)) @ self._head_w.T  # the model's dtype and device
        top = logits.topk(TOP_K, dim=-1).indices.cpu()
        return (top == torch.tensor(next_ids)[:, None]).any(-1)

    def _flush_head(self) -> None:
        """One matrix product for a batch of files' sampled positions."""
        if not self._head_queue:
            return
        hits = self._head_hits(torch.cat([st for _, st, _ in self._head_queue]),
                               [t for _, _, nxt in self._head_queue for t in nxt])
        k = 0
        for name, st, _ in self._head_queue:
            self._head_rates[name] = (int(hits[k:k + len(st)].sum()), len(st))
            k += len(st)
        self._head_queue.clear()

    @torch.no_grad()
    def _flush_prefix(self, p: int) -> None:
        from .engines.hf_reference import hidden_states

        batch = self._prefix_queue.pop(p, [])
        if len(self._prefix_refs) > 4 * PREFIX_BATCH:
            self._prefix_refs.clear()
        todo = list(dict.fromkeys(tuple(ids) for _, ids, _ in batch if tuple(ids) not in self._prefix_refs))
        if todo:  # files that begin alike (a chat template's system prompt) share one reference
            self._prefix_forwards += len(todo)
            ref = hidden_states(self.model, [list(t) for t in todo], self.layer_ids).float()  # [B, p, L, H]
            self._prefix_refs.update(zip(todo, ref))
        for name, ids, got in batch:
            r = self._prefix_refs[tuple(ids)]
            got = got.float()
            cos, ratio = compare_states(got, r)
            cos = cos.mean(0)  # [L]
            self._prefix_stats.append({"file": name, "cos": cos.tolist(), "log_ratio": ratio.tolist(), "tokens": p})
            for j, lid in enumerate(self.layer_ids):
                c = float(cos[j])
                if c < self.min_cosine:
                    self._find(name, "prefix-parity", f"layer id {lid}: mean cosine {c:.4f} < {self.min_cosine} "
                               f"against transformers over the first {p} tokens (wrong, swapped or shifted layer, "
                               f"positions shifted, or another sample's states)")
            for reason in norm_problems(ratio.tolist(), self.layer_ids, self.max_norm_deviation):
                self._find(name, "prefix-parity", f"{reason} over the first {p} tokens")

    def _find(self, name: str, check: str, reason: str) -> None:
        self.findings.setdefault(name, []).append(Finding(check, reason))

    # ---- after every file -----------------------------------------------------------------------
    def finish(self, parity_passed: set[str]) -> dict:
        """Judge what needs every file (or the calibration); returns the per-check summary."""
        for p in list(self._prefix_queue):
            self._flush_prefix(p)
        self._flush_head()
        summary = {"files": summary_files(self._hashes), "tokens": self._tokens}
        summary["zero-rows"] = {"files_checked": summary["files"], "files_with_zero_rows": self._zero_files}
        summary["prefix-parity"] = self._prefix_summary()
        summary["head"] = self._judge_head(parity_passed)
        summary["duplicate"] = self._judge_duplicates()
        return summary

    def _prefix_summary(self) -> dict:
        stats = self._prefix_stats
        clean = [s for s in stats if not any(f.check == "prefix-parity" for f in self.findings.get(s["file"], []))]
        out = {"files_checked": len(stats), "tokens_checked": sum(s["tokens"] for s in stats),
               "prefix_tokens": self.prefix_tokens, "reference_forwards": self._prefix_forwards,
               "min_cosine": self.min_cosine,
               "max_norm_deviation": self.max_norm_deviation}
        if clean:
            out["passing_files_min_cosine_per_layer"] = {
                str(lid): round(min(s["cos"][j] for s in clean), 6) for j, lid in enumerate(self.layer_ids)}
            out["passing_files_max_abs_log_norm_ratio_per_layer"] = {
                str(lid): round(max(abs(s["log_ratio"][j]) for s in clean), 5) for j, lid in enumerate(self.layer_ids)}
        return out

    def _judge_head(self, parity_passed: set[str]) -> dict:
        if not self.head_ok:
            return {"covered": False, "why": self._why}
        calib = {k: v for k, v in self._calibration.items() if k in parity_passed and k not in self.findings}
        if not calib:
            return {"covered": False, "why": "no parity-passing file with 8 or more predictable positions to calibrate on"}
        median = sorted(calib.values())[len(calib) // 2]
        # the lowest clean rate, leaving out a calibration file far below the others (an odd but correct answer
        # must not lower the threshold for every file, nor switch the check off)
        lowest = min(v for v in calib.values() if v >= median / 2)
        out = {"top_k": TOP_K, "positions_per_file": self.head_positions,
               "calibration_files": len(calib), "clean_rate_min": round(lowest, 4),
               "clean_rate_median": round(median, 4)}
        if median < MIN_INFORMATIVE:
            return {"covered": False, "why": f"the target's head predicts clean data too rarely to judge by "
                                             f"(median clean top-{TOP_K} rate {median:.2f} < {MIN_INFORMATIVE})", **out}
        threshold = self.head_fraction * lowest
        rates = {k: h / n for k, (h, n) in self._head_rates.items()}
        for name, rate in sorted(rates.items()):
            if rate < threshold:
                h, n = self._head_rates[name]
                self._find(name, "head", f"the target's head puts the prepared next token in its top {TOP_K} at "
                           f"{h}/{n} sampled positions ({rate:.2f}; clean files >= {lowest:.2f}, threshold "
                           f"{threshold:.2f}): states of another sample, shifted positions or corrupted values")
        passing = [r for k, r in rates.items() if r >= threshold]
        return {"covered": True, **out, "threshold": round(threshold, 4), "files_checked": len(rates),
                "positions_checked": sum(n for _, n in self._head_rates.values()),
                "files_without_enough_positions": summary_files(self._hashes) - len(rates),
                "passing_files_min_rate": round(min(passing), 4) if passing else None}

    def _judge_duplicates(self) -> dict:
        groups = 0
        for digest, members in self._hashes.items():
            if len({ids for _, ids in members}) > 1:
                groups += 1
                names = [n for n, _ in members]
                for name in names:
                    others = ", ".join(n for n in names if n != name)
                    self._find(name, "duplicate", f"the same hidden states as {others} for different token ids "
                               f"(one request's states returned for another)")
        return {"files_checked": summary_files(self._hashes), "groups_found": groups}


def summary_files(hashes: dict) -> int:
    return sum(len(v) for v in hashes.values())


def _eligible_positions(n: int, mask: list[int] | None) -> list[int]:
    """Positions t whose next token t+1 is an answer token (the loss mask), or every t when the data has no mask.
    A file with fewer than 8 is not judged (prompt text is predicted far less often than answers)."""
    return [t for t in range(n - 1) if mask[t + 1]] if mask is not None else list(range(n - 1))


def norm_problems(log_ratios: list[float], layer_ids: list[int], tolerance: float) -> list[str]:
    """Rescaled values: the file's scale (the median over layers of each layer's mean log norm ratio against the
    reference) must be within `tolerance`, and each layer within LAYER_NORM_FACTOR x tolerance. The median, because
    the deepest layers carry the most bf16 noise (SmolLM2's id 30: up to 1.4 % over 16 tokens, id 2: 0.06 %)."""
    import statistics

    scale = statistics.median(log_ratios)
    out = []
    if abs(scale) > tolerance:
        out.append(f"all layers: norm {torch.tensor(scale).exp():.4f}x the transformers reference (median over "
                   f"layer ids {layer_ids}; allowed ±{tolerance:.0%}): rescaled values")
    out += [f"layer id {lid}: norm {torch.tensor(r).exp():.4f}x the transformers reference (allowed "
            f"±{LAYER_NORM_FACTOR * tolerance:.0%} for one layer): rescaled values"
            for lid, r in zip(layer_ids, log_ratios) if abs(r) > LAYER_NORM_FACTOR * tolerance]
    return out


def compare_states(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Extracted vs reference states [T, L, H]: per-token cosine [T, L] and the mean log norm ratio per layer [L]."""
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    ratio = (got.norm(dim=-1).clamp_min(1e-12) / ref.norm(dim=-1).clamp_min(1e-12)).log().mean(0)
    return cos, ratio
