"""Write an answers-only seed: the target's regenerated answers without the prompts, for `data.seed_answers`.

    python tests/bench/h200/seed_regen_cache.py --answers-only CONVERSATIONS.jsonl[.gz|.xz] [MORE ...] OUT.jsonl.xz

CONVERSATIONS is an earlier run's `prepare/conversations.jsonl` (or an answers-only file): OUT gets `{"id",
"answers": [...]}` per conversation, so the repository can keep a seed without redistributing the prompt sets
(data/seeds/). Inputs are read as gzip, xz or plain text by their first bytes; OUT is written as xz when its name
ends in .xz (the seed in data/seeds/ since session 36: half gzip's size, and every device call carries the tree),
else as gzip. Until session 51 this script also seeded a run (`--config C CONVERSATIONS`, writing prepare's resume
cache); prepare now reads a seed itself, `--set data.seed_answers='"FILE"'` (pipeline/seed_answers.py), which saves
the second pass over the sources that script made.
"""

import gzip
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pipeline.seed_answers import open_text  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] == ["--answers-only"] and len(argv) >= 3:
        return answers_only([Path(a) for a in argv[1:-1]], Path(argv[-1]))
    print(__doc__, file=sys.stderr)
    return 2


def answers_only(sources: list[Path], out: Path) -> int:
    """CONVERSATIONS (or answers-only files) -> {"id", "answers"} per conversation (xz or gzip by OUT's name,
    reproducible bytes), in the order first met. Several inputs merge by id, so the seed in data/seeds/ can be one of
    them (it is read whole before OUT is written): a session's new answers are added to it (name the seed first, so
    its order stays). The same id with other answers is refused (greedy answers of the same prompts do not differ:
    something else changed)."""
    merged: dict[str, list[str]] = {}
    for src in sources:
        with open_text(src) as f:
            for line in f:
                rec = json.loads(line)
                answers = rec["answers"] if "answers" in rec else [m["content"] for m in rec["messages"]
                                                                    if m["role"] == "assistant"]
                if merged.setdefault(rec["id"], answers) != answers:
                    sys.exit(f"[seed] {rec['id']}: {src} has other answers than an earlier input; not merged")
    lines = [json.dumps({"id": i, "answers": a}, ensure_ascii=False) for i, a in merged.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ("\n".join(lines) + "\n").encode("utf-8")
    out.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME) if out.name.endswith(".xz")
                    else gzip.compress(text, compresslevel=9, mtime=0))
    print(f"[seed] {len(lines)} conversations' answers -> {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
