"""Are the user turns of regenerated conversations a prefix of their source's user turns (none skipped)?

    python tests/bench/turn_order.py SOURCE.jsonl[.gz] REGENERATED.jsonl[.gz]

SOURCE is what prepare read (data.path), REGENERATED its `prepare/conversations.jsonl`. Before f4d7486 an
all-turn regeneration went on after a turn whose prompt was too long, so a later question could be answered in a
context where the long one was never asked; this counts such conversations in data made before the fix.
"""
import gzip
import json
import sys
from collections import Counter


def read(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            yield json.loads(line)


def main(source: str, regenerated: str) -> int:
    users = {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "user"] for c in read(source)}
    n = skipped = 0
    turns = Counter()
    for c in read(regenerated):
        u = [m["content"] for m in c["messages"] if m["role"] == "user"]
        n += 1
        turns[len(u)] += 1
        skipped += u != users[c["id"]][: len(u)]
    print(f"{n} conversations, {sum(k * v for k, v in turns.items())} answers, {skipped} with a skipped user turn")
    print("answers per conversation:", dict(sorted(turns.items())))
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
