"""Prompt tokenization one by one (chat.prompt_ids) vs batched (chat.prompt_ids_batch), as prepare's rounds use it.

    .venv/bin/python tests/bench/prompt_tokenization.py CONVERSATIONS.jsonl[.gz] [N]

CONVERSATIONS: a prepare/conversations.jsonl (e.g. .gpu/s18-conversations.jsonl.gz); the first N conversations'
rounds (system turns + earlier turns + user turn r) are tokenized both ways; prints seconds and whether equal.
"""
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.env import setup_env  # noqa: E402

setup_env()
from transformers import AutoTokenizer  # noqa: E402

from pipeline.chat import prompt_ids, prompt_ids_batch  # noqa: E402

src, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1000
tok = AutoTokenizer.from_pretrained("data/models/SmolLM2-135M-Instruct")
prompts = []
with (gzip.open if src.suffix == ".gz" else open)(src, "rt") as f:
    for i, line in enumerate(f):
        if i >= n:
            break
        msgs = json.loads(line)["messages"]
        history = [m for m in msgs if m["role"] == "system"]
        turns = [m for m in msgs if m["role"] in ("user", "assistant")]
        for user, answer in zip(turns[0::2], turns[1::2]):
            prompts.append(history + [user])
            history = history + [user, answer]
t = time.time()
one = [prompt_ids(tok, p) for p in prompts]
t_one = time.time() - t
t = time.time()
batched = prompt_ids_batch(tok, prompts)
t_batch = time.time() - t
print(f"{len(prompts)} prompts: one by one {t_one:.2f} s ({1000 * t_one / len(prompts):.2f} ms each), "
      f"batched {t_batch:.2f} s, equal: {one == batched}")
