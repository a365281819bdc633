"""Prompts written by the target itself (Magpie-style) -> one conversations file for `data.sources` (issue 15).

    python -m pipeline.self_prompts --config CONFIG --n 24000 --out data/prompts/self-prompts.jsonl.gz

An instruction-tuned target continues its own chat template: given only the template's opening of a user turn
(`<|im_start|>user\\n` after the system turn), it writes a user request of the kind it was tuned on, and stops at
the end-of-turn token. This is "Magpie" (Xu et al. 2024, arXiv:2406.08464): no prompt set, no licence question,
as many prompts as device time buys, all in the target's own training distribution. A share of the prompts is
steered toward a kind of task by a system prompt used ONLY while the request is written (`CATEGORIES`); the
conversation is stored without it, so prepare regenerates the answer under the target's default context, as
MT-bench and a plain chat request see it. Two categories (`writing_task`, `explain_task`; off unless `--shares`
names them) also write the request's first words (`OPENINGS`: "Write a", "Explain", ...), which the target then
continues: its own requests almost never open with a task verb, MT-bench's mostly do (NOTES "Session 31").

Sampling: pure temperature, with one of two engines (`--engine`):
- `hf` (the default; the lent H200 has no vLLM): transformers (hf_engine.generate, on the GPU when there is one),
  one torch generator seeded by --seed, drawn batch by batch: the same config, n, seed, batch size, device and
  torch/transformers versions give the same file (tested on CPU; not repeated on a GPU).
- `vllm`: the config's vLLM engine, one seed per request (`request_seed`, 32 bits: --seed 0..255; one seed for
  all would give identical prompts identical requests), chunked prefill off (vLLM 0.32's CPU worker fails on a
  seeded request whose prefill is split: "CPU Generator does not use offset"). The same config, n, seed and
  versions give the same file on the same machine (tested on CPU). 3.2x faster than `hf` on the 2-core CPU (256
  requests: 41.3 vs 132.6 s; tests/bench/self_prompts_engines.sh).

Kept, in this order (each drop counted in `<out>.sources.json`): a request that ended at the end-of-turn token
(not cut at --max-new-tokens) with no other special token before it (decoding would drop it silently: a
request running on into a made-up assistant turn), of at least MIN_CHARS characters, not a duplicate of an earlier one (normalised,
as prompt_sets does), and no MT-bench near-duplicate (`datasets.near_duplicates`; prepare checks every source
again). Output records are prompt_sets' format: `{"id", "set": <category>, "conversations": [human, gpt]}`, the
gpt turn the placeholder answer (for `data.regenerate = "first_turn"` or `"all_turns"` only).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import REPO_ROOT, Config, repo_relative
from .manifest import StepError, sha256_file
from .prompt_sets import PLACEHOLDER, normalise, write_records

MIN_CHARS = 12
# (category, share of the prompts, system prompt that steers the request while it is written; None: the target's
# default context). The eight kinds are MT-bench's own categories (its "STEM" named science here): the reference
# workload is general chat, and these are the kinds of task it is scored on. That steers topics, not items (no
# MT-bench question is shown to the target, and the near-duplicate check runs on every request); judge a draft
# trained on them on the held-out ShareGPT prompts as well (`eval.heldout_source`). The shares are a choice, not tuned;
# `--shares` changes some (session 28: MT-bench's writing prompts have the lowest acceptance, NOTES "Session 28").
CATEGORIES = [
    ("default", 0.40, None),
    ("writing", 0.075, "You are a writing assistant. Users ask you to write stories, poems, emails, blog posts, "
                       "speeches and essays, or to edit their drafts."),
    ("roleplay", 0.075, "You are an assistant that plays roles. Users ask you to pretend to be a character, a "
                        "famous person or a professional and to answer in that role."),
    ("reasoning", 0.075, "You are a logical thinker. Users give you puzzles, riddles and questions that need "
                         "step-by-step reasoning."),
    ("math", 0.075, "You are a math tutor. Users give you math problems, equations and word problems to solve "
                    "step by step."),
    ("coding", 0.075, "You are an expert programmer. Users ask you to write, explain and debug code in Python, "
                      "JavaScript, C++, Java and SQL."),
    ("extraction", 0.075, "You are a data assistant. Users paste a text, a table or a document and ask you to "
                          "summarise it, extract facts from it or reformat it."),
    ("science", 0.075, "You are a science teacher. Users ask you questions about physics, chemistry, biology, "
                       "engineering and medicine."),
    ("humanities", 0.075, "You are a humanities scholar. Users ask you about history, philosophy, economics, law, "
                          "literature and the arts."),
    # Share 0 unless `--shares` names them, so every file written before them is written the same again. Session
    # 31 (NOTES, `tests/bench/request_style.py`): MT-bench's writing, STEM and humanities prompts are complete
    # assignments, 40-80 % of them opening with a verb of a task ("Compose an engaging travel blog post about...",
    # "Explain ... and list five examples"), while 84 % of the target's own requests ask for help or talk about the
    # user ("I'm looking to...", "Can you help me...") and 1 % open with such a verb; a system prompt alone did not
    # move that (1 % again in a 500-request trial). These two categories also write the request's first words
    # (OPENINGS): the target continues "Write a" or "Explain" with a topic and requirements of its own.
    ("writing_task", 0.0, "You are a writer. Each user gives you one complete writing assignment, with its topic and "
                          "requirements spelled out, and you write the finished piece."),
    ("explain_task", 0.0, "You are an expert teacher. Each user gives you one precise task about a specific topic in "
                          "science, technology, history, economics, law, philosophy or the arts."),
]
# A category's request openings (request i of the category starts with OPENINGS[category][i % len]); the stored
# request is the opening followed by the target's continuation.
OPENINGS = {
    "writing_task": ("Write a", "Compose a", "Draft an email", "Write a short story", "Write a poem", "Craft a",
                     "Write a persuasive", "Write a blog post", "Create a", "Describe a", "Write a speech",
                     "Write a letter"),
    "explain_task": ("Explain", "Describe", "Compare", "Discuss", "What is", "How does", "Provide an overview of",
                     "List five", "Outline", "Summarize", "What are the main", "Why did"),
}


def request_prefix(tok, system: str | None, opening: str = "") -> list[int]:
    """Token ids of the chat template up to the start of a user turn's text (the system turn first, if any), then
    `opening`, the request's first words (OPENINGS), if any."""
    marker = "\x00REQUEST\x00"
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    try:
        text = tok.apply_chat_template(msgs, tokenize=False)
    except Exception as e:  # a template without a chat format, or one that refuses a system turn
        raise StepError(f"the target's chat template cannot render {[m['role'] for m in msgs]}: {e}") from e
    if marker not in text:
        raise StepError("the target's chat template does not show a user turn's text; self_prompts needs one")
    return tok(text[: text.index(marker)] + opening, add_special_tokens=False).input_ids


def parse_shares(text: str) -> dict[str, float]:
    """`--shares writing=0.2,science=0.15` -> {category: share}: the named categories' shares instead of
    CATEGORIES' (the others keep theirs; all are then scaled to sum to 1)."""
    names = [name for name, _, _ in CATEGORIES]
    shares = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = (x.strip() for x in part.partition("="))
        try:
            share = float(value)  # "" (no "=") fails here too
        except ValueError:
            share = float("nan")
        if name not in names or not 0 <= share < float("inf"):  # NaN fails both
            raise StepError(f"--shares {text!r}: {part!r} is not <category>=<share >= 0>; the categories are "
                            f"{', '.join(names)}")
        shares[name] = share
    return shares


def category_shares(shares: dict[str, float] | None = None) -> list[float]:
    """Each category's share of the requests, in CATEGORIES' order, summing to 1."""
    raw = [(shares or {}).get(name, share) for name, share, _ in CATEGORIES]
    if sum(raw) <= 0:
        raise StepError("--shares leaves every category at 0: give at least one a share above 0")
    return [x / sum(raw) for x in raw]


def counts(n: int, shares: dict[str, float] | None = None) -> list[int]:
    """n split over CATEGORIES by share (largest remainders; a tie goes to the earlier category); `shares`
    replaces the named categories' shares (parse_shares)."""
    exact = [n * share for share in category_shares(shares)]
    each = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: -(exact[i] - each[i]))[: n - sum(each)]:
        each[i] += 1
    return each


def select(generations: list[tuple[str, str, str, bool]], questions: list[str]) -> tuple[list[dict], dict]:
    """(category, text, finish_reason, special token before the end) per generation -> kept records and drops by
    reason (see the module doc)."""
    from .datasets import near_duplicates

    dropped: dict[str, int] = {}
    seen: set[str] = set()
    kept = []
    for i, (cat, text, reason, special) in enumerate(generations):
        text = text.strip()
        key = normalise(text)
        why = ("unfinished (hit --max-new-tokens)" if reason != "stop" else
               "special token before the end of the request" if special else
               f"shorter than {MIN_CHARS} characters" if len(text) < MIN_CHARS else
               "duplicate" if key in seen else None)
        if why:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        seen.add(key)
        kept.append({"id": f"{cat}-{i:06d}", "set": cat,
                     "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": PLACEHOLDER}]})
    msgs = [{"id": r["id"], "messages": [{"role": "user", "content": r["conversations"][0]["value"]}]} for r in kept]
    hits = near_duplicates(msgs, questions)
    if hits:
        dropped["MT-bench near-duplicate"] = len(hits)
    return [r for r in kept if r["id"] not in hits], dropped


SEED_BITS, INDEX_BITS = 8, 24   # request_seed's 32 bits: --seed below 256, at most 2**24 requests


def request_seed(seed: int, i: int) -> int:
    """The vLLM engine's seed for request i of a run seeded `seed`, `(seed << 24) | i`: distinct for every
    (seed, i) with seed < 2**8 and i < 2**24, so the requests of two seeds never share a random stream.

    It must fit in 32 bits: torch's CPU generator (vLLM's CPU sampler) keeps only a seed's low 32 bits, so the
    `(seed << 32) | i` used before session 49 gave request i of every seed the same stream on a CPU (set 18,
    written on the CPU with seed 18, repeated 3,029 of set 15's requests: NOTES "Session 49")."""
    if not (0 <= seed < 2**SEED_BITS and 0 <= i < 2**INDEX_BITS):
        raise StepError(f"--seed {seed}, request {i}: the vLLM engine's per-request seeds need a seed in "
                        f"0..{2**SEED_BITS - 1} and at most 2**{INDEX_BITS} requests (torch's CPU generator keeps "
                        f"only 32 bits of a seed)")
    return (seed << INDEX_BITS) | i


def write_requests(cfg: Config, prompts: list[list[int]], *, engine: str, temperature: float, max_new_tokens: int,
                   batch_size: int, seed: int, progress: bool) -> tuple[list, dict]:
    """The target's continuation of each prompt (hf_engine.Generation / vllm_offline.Generation) and what made
    them, for the sidecar."""
    import torch
    import transformers

    if engine == "hf":
        from .engines import hf_engine

        gens = hf_engine.generate(cfg.model_path, prompts, dtype=cfg.model.dtype, batch_size=batch_size,
                                  trust_remote_code=cfg.model.trust_remote_code, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed, progress=progress)
        made = {"batch_size": batch_size, "engine": "transformers (pipeline.engines.hf_engine)",
                "transformers": transformers.__version__}
    elif engine == "vllm":
        try:
            import vllm
        except ImportError as e:
            raise StepError(f"--engine vllm: vLLM is not installed here ({e}); use --engine hf") from e
        from .engines.vllm_offline import close, generate, target_llm

        # chunked prefill off: seeded requests on the CPU worker (the module doc)
        llm = target_llm(cfg, seed=seed, enable_chunked_prefill=False)
        try:
            gens = generate(llm, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=[request_seed(seed, i) for i in range(len(prompts))])
        finally:
            close(llm)
        made = {"engine": f"vLLM (pipeline.engines.vllm_offline), one seed per request: (seed << {INDEX_BITS}) | index",
                "vllm": vllm.__version__}
    else:
        raise StepError(f"--engine {engine!r}: use hf (transformers) or vllm")
    made.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__)
    return gens, made


def build(cfg: Config, n: int, out: Path, questions: list[str], *, temperature: float, max_new_tokens: int,
          batch_size: int, seed: int, progress: bool = True, shares: dict[str, float] | None = None,
          engine: str = "hf") -> dict:
    """Write `out` and `<out>.sources.json`; returns the sidecar's content."""
    from .prepare import load_tokenizer

    if n < 1:
        raise StepError(f"--n {n}: ask for at least one prompt")
    if seed < 0 or n > 2**32:
        raise StepError(f"--seed {seed} / --n {n}: the seed must be >= 0 and n at most 2**32")
    if engine == "vllm":
        request_seed(seed, n - 1)   # refuses a seed or n out of its range before the model loads
    t0 = time.time()
    tok = load_tokenizer(cfg)
    asked = counts(n, shares)
    cats, openings, prompts = [], [], []
    for (name, _, system), k in zip(CATEGORIES, asked):
        firsts = OPENINGS.get(name, ("",))
        prefixes = [request_prefix(tok, system, first) for first in firsts]
        for i in range(k):
            cats.append(name)
            openings.append(firsts[i % len(firsts)])
            prompts.append(prefixes[i % len(firsts)])
    gens, made = write_requests(cfg, prompts, engine=engine, temperature=temperature,
                                max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, progress=progress)
    special = set(tok.all_special_ids)
    records, dropped = select([(c, o + g.text, g.finish_reason, any(t in special for t in g.token_ids[:-1]))
                               for c, o, g in zip(cats, openings, gens)], questions)
    write_records(records, out)
    per_cat = {name: {"share": round(share, 6), "asked": k, "kept": sum(r["set"] == name for r in records),
                      "system_prompt_while_writing": s,
                      **({"openings": list(OPENINGS[name])} if name in OPENINGS else {})}
               for (name, _, s), share, k in zip(CATEGORIES, category_shares(shares), asked)}
    sidecar = {
        "output": repo_relative(out), "output_sha256": sha256_file(out), "conversations": len(records),
        "format": "prompt_sets' format: one user turn (written by the target) + the placeholder answer",
        "placeholder_answer": PLACEHOLDER, "use_with": 'data.regenerate = "first_turn" or "all_turns"',
        "method": "Magpie (arXiv:2406.08464): the target continues its own chat template's opening of a user turn",
        "model": {"path": repo_relative(cfg.model_path), "dtype": cfg.model.dtype},
        "sampling": {"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed, **made},
        "asked": n, "dropped": dropped, "dropped_total": sum(dropped.values()),
        "mtbench_questions_checked": len(questions), "categories": per_cat,
        "seconds": round(time.time() - t0, 1),
    }
    side = out.with_name(out.name + ".sources.json")
    side.write_text(json.dumps(sidecar, indent=2, ensure_ascii=False) + "\n")
    return sidecar


def main(argv=None) -> int:
    from .__main__ import parse_set
    from .config import ConfigError, load_config
    from .datasets import load_mtbench
    from .env import setup_env

    ap = argparse.ArgumentParser(prog="python -m pipeline.self_prompts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the run's config: its target (model.path, model.dtype)")
    ap.add_argument("--set", action="append", default=[], help="override a config key (key=value)")
    ap.add_argument("--n", type=int, required=True, help="requests to write (the file keeps those that pass)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                    help="hf: transformers, batch by batch (the lent H200); vllm: the config's vLLM engine, one seed "
                    "per request (3.2x faster on a 2-core CPU)")
    ap.add_argument("--batch-size", type=int, default=0, help="hf: default the config's data.batch_size")
    ap.add_argument("--seed", type=int, default=None, help="default: the config's run.seed")
    ap.add_argument("--shares", default="", help="other shares for some categories, e.g. writing=0.2,science=0.15 "
                    "(the rest keep theirs; all are scaled to sum to 1)")
    args = ap.parse_args(argv)
    setup_env()
    try:
        cfg = load_config(args.config, parse_set(args.set))
        out = Path(args.out)
        out = out if out.is_absolute() else REPO_ROOT / out
        questions = [t for q in load_mtbench(cfg.run.stack) for t in q["turns"]]
        side = build(cfg, args.n, out, questions, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                     batch_size=args.batch_size or cfg.data.batch_size,
                     seed=cfg.run.seed if args.seed is None else args.seed, shares=parse_shares(args.shares),
                     engine=args.engine)
    except (ConfigError, StepError) as e:
        print(f"self_prompts: {e}", file=sys.stderr)
        return 1
    for name, c in side["categories"].items():
        print(f"{name:11s} asked {c['asked']:6d} kept {c['kept']:6d}")
    print(f"{side['conversations']} of {side['asked']} requests -> {side['output']} ({side['seconds']} s); "
          f"dropped {side['dropped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
