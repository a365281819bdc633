"""How much more training data multi-turn regeneration (`data.regenerate = "all"`) could add, before running it.

    .venv/bin/python tests/bench/multiturn_headroom.py CONVERSATIONS.jsonl[.gz] [--config configs/smollm2-quality.toml]

CONVERSATIONS: a first-turn run's `prepare/conversations.jsonl` (the target's first answers). For every selected
full ShareGPT conversation with a second user turn, the round-2 prompt is built exactly as prepare would (first
user turn, the target's real first answer, second user turn) and counted if it fits the window
(model.max_model_len - data.max_new_tokens). Later rounds are estimated with an answer of the median
first-answer length. Prints the number of extra answers per round against the first round's.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("conversations", type=Path)
    ap.add_argument("--config", default="configs/smollm2-quality.toml")
    a = ap.parse_args()
    from pipeline.env import setup_env

    setup_env()  # caches inside the repo, before torch and transformers are imported
    from pipeline.chat import prompt_ids
    from pipeline.config import load_config
    from pipeline.prepare import load_tokenizer, selected_conversations

    cfg = load_config(a.config)
    tok = load_tokenizer(cfg)
    budget = cfg.model.max_model_len - cfg.data.max_new_tokens
    opener = gzip.open if a.conversations.suffix == ".gz" else open
    answers = {}
    with opener(a.conversations, "rt") as f:
        for line in f:
            c = json.loads(line)
            answers[c["id"]] = next(m["content"] for m in c["messages"] if m["role"] == "assistant")
    median_len = int(statistics.median(len(tok.encode(t, add_special_tokens=False)) for t in answers.values()))
    selected, _, _ = selected_conversations(cfg)
    per_round = {1: len(answers)}
    for c in selected:
        if c["id"] not in answers:
            continue
        users = [m for m in c["messages"] if m["role"] == "user"]
        history = [m for m in c["messages"] if m["role"] == "system"] + [users[0], {"role": "assistant", "content": answers[c["id"]]}]
        extra = 0  # tokens of estimated (not real) answers after round 2
        for r in range(1, len(users)):
            n = len(prompt_ids(tok, history + [users[r]])) + extra
            if n > budget:
                break
            per_round[r + 1] = per_round.get(r + 1, 0) + 1
            history += [users[r], {"role": "assistant", "content": ""}]  # its tokens are counted in `extra`
            extra += median_len
    first = per_round[1]
    print(json.dumps({"window_tokens_for_prompt": budget, "median_first_answer_tokens": median_len,
                      "answers_per_round": per_round, "extra_answers": sum(per_round.values()) - first,
                      "extra_fraction": round((sum(per_round.values()) - first) / first, 3)}))


if __name__ == "__main__":
    main()
