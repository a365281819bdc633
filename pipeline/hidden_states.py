"""The hidden-state file format and its cheap checks.

One safetensors file per sample, as vLLM's extract_hidden_states connector writes it and speculators
0.9.0 reads it: {"hidden_states": [T, L, H] (model dtype), "token_ids": [T]}, layers in ascending id
order (the ids live in the step manifest and in `hidden_states.json` beside the files).
"""
from __future__ import annotations

import json
from pathlib import Path

META = "hidden_states.json"


def file_name(index: int) -> str:
    return f"hs_{index}.safetensors"


def header(path: Path) -> dict:
    """The safetensors JSON header (dtypes, shapes) without reading tensor data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 1 << 24:
            raise ValueError(f"{path}: not a safetensors file (header size {n})")
        return json.loads(f.read(n))


def check_header(path: Path, tokens: int, num_ids: int, hidden: int) -> str | None:
    """A reason the file cannot be this sample's hidden states, or None if its header fits."""
    try:
        h = header(path)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        return f"unreadable: {e}"
    hs, ids = h.get("hidden_states"), h.get("token_ids")
    if hs is None or ids is None:
        return f"missing tensors (has {sorted(k for k in h if k != '__metadata__')})"
    if hs["shape"] != [tokens, num_ids, hidden]:
        return f"hidden_states shape {hs['shape']} != expected {[tokens, num_ids, hidden]}"
    if ids["shape"] != [tokens]:
        return f"token_ids shape {ids['shape']} != expected {[tokens]}"
    return truncation(path, h)


def truncation(path: Path, h: dict) -> str | None:
    """Why a safetensors file with header h is cut short (its size is not what the header promises), or None."""
    end = max((t["data_offsets"][1] for k, t in h.items() if k != "__metadata__"), default=0)
    n = int.from_bytes(open(path, "rb").read(8), "little")
    if path.stat().st_size != 8 + n + end:
        return f"truncated: {path.stat().st_size} bytes, header promises {8 + n + end}"
    return None


def load(path: Path):
    from safetensors.torch import load_file

    d = load_file(str(path))
    return d["hidden_states"], d["token_ids"]


DIGESTS = "digests.json"  # beside the files: {"<split>/hs_<i>.safetensors": {size, mtime_ns, inode, sha256, hashed_at_ns}}
# A rewrite of the same size within one timestamp tick of hashing would keep the mtime (ticks are up to 1-2 s on
# some file systems): entries of files modified that close to their hashing are not trusted (git's "racy clean").
RACY_NS = 2_000_000_000


def content_digests(root: Path, names: list[str], known: dict[str, dict], workers: int = 8) -> dict[str, dict]:
    """{size, mtime_ns, inode, sha256, hashed_at_ns} of each file `root/name`. An entry of `known` is reused while
    the file's size, mtime and inode still match it and the file was last modified well before it was hashed;
    other files (new, rewritten, re-extracted, copied) are read, in parallel (hashlib releases the GIL), with a
    progress bar when there are many."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from .manifest import sha256_file

    def one(name: str) -> dict:
        st = (root / name).stat()
        now = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        old = known.get(name)
        if (isinstance(old, dict) and all(old.get(k) == v for k, v in now.items()) and old.get("sha256")
                and st.st_mtime_ns < old.get("hashed_at_ns", 0) - RACY_NS):
            return old
        hashed_at = time.time_ns()
        return {**now, "sha256": sha256_file(root / name), "hashed_at_ns": hashed_at}

    with ThreadPoolExecutor(workers) as pool:
        rows = list(tqdm(pool.map(one, names), total=len(names), desc="content hashes", unit="file",
                         disable=len(names) < 1000))
    return dict(zip(names, rows))
