"""How requests are phrased: complete assignments ("Write a blog post about...") or asks for help ("Can you help
me...")? MT-bench's prompts beside a prompts file's categories (pipeline.self_prompts' output, or any source).

    .venv/bin/python tests/bench/request_style.py [--stack vllm-0.32] FILE [FILE ...]

Session 31 (NOTES): MT-bench's writing, STEM and humanities prompts have the drafter's lowest acceptance, and more
self-written "writing" requests did not raise it. MT-bench asks for a finished piece or explanation in the
imperative; many of the target's own requests ask for help or talk about the user. This counts, per category:
- `imperative`: the first word is a verb of a task (write, compose, explain, list, ...: TASK_VERBS), or "Please"
  followed by one;
- `help`: the request asks for help or talks about the user first ("Can you", "Could you", "I", "I'm", "Help me", "My");
- `question`: the rest that end with "?" (e.g. "What is the central dogma of molecular biology?");
- mean words of the request.
A crude, transparent classifier: its point is the comparison between files and with MT-bench, not the exact shares.
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pipeline.datasets import load_mtbench  # noqa: E402

TASK_VERBS = {
    "write", "compose", "draft", "create", "craft", "describe", "explain", "discuss", "compare", "provide", "list",
    "outline", "imagine", "suggest", "edit", "summarize", "summarise", "give", "share", "develop", "design",
    "generate", "rewrite", "identify", "evaluate", "analyze", "analyse", "translate", "construct", "embrace",
    "pretend", "act", "picture", "consider", "use", "extract", "read", "solve", "implement", "find", "calculate",
    "tell", "name", "define", "propose", "plan", "prepare", "make", "produce", "argue", "convince",
}
HELP_STARTS = ("can you", "could you", "would you", "will you", "i ", "i'm", "i am", "i've", "i have", "i'd", "help me",
               "my ", "we ", "we're", "hey", "hi", "hello")


def style(text: str) -> str:
    t = text.strip().lower()
    words = re.findall(r"[a-z']+", t)
    first = words[0] if words else ""
    if first == "please" and len(words) > 1:
        first = words[1]
    if t.startswith(HELP_STARTS):
        return "help"
    if first in TASK_VERBS:
        return "imperative"
    return "question" if t.rstrip().endswith("?") else "other"


def first_turn(record: dict) -> str:
    turns = record.get("conversations") or record.get("messages") or []
    for t in turns:
        if t.get("from", t.get("role")) in ("human", "user"):
            return t.get("value", t.get("content", ""))
    return ""


def table(rows: dict[str, list[str]]) -> list[dict]:
    out = []
    for name, texts in rows.items():
        kinds = defaultdict(int)
        for t in texts:
            kinds[style(t)] += 1
        n = len(texts)
        out.append({"set": name, "n": n, **{k: round(kinds[k] / n, 3) for k in ("imperative", "help", "question",
                                                                                  "other")},
                    "words": round(sum(len(t.split()) for t in texts) / n, 1)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--stack", default="vllm-0.32")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()
    rows: dict[str, list[str]] = defaultdict(list)
    for q in load_mtbench(args.stack):
        rows[f"MT-bench {q['category']}"].append(q["turns"][0])
    for f in args.files:
        opener = gzip.open if f.endswith(".gz") else open
        with opener(f, "rt") as fh:
            for line in fh:
                r = json.loads(line)
                rows[f"{Path(f).name.split('.')[0]} {r.get('set', '')}".strip()].append(first_turn(r))
    result = table(rows)
    print(f"| set | n | imperative | help | question | other | words |\n|---|---|---|---|---|---|---|")
    for r in result:
        print(f"| {r['set']} | {r['n']} | {r['imperative']:.2f} | {r['help']:.2f} | {r['question']:.2f} | "
              f"{r['other']:.2f} | {r['words']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
