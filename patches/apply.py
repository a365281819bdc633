#!/usr/bin/env python3
"""Apply, check and hash the versioned source-patch series under patches/.

Layout: patches/<dist>/<version>/series lists patch files (one per line, '#'
comments and blank lines ignored) that live next to it. Words after a file name
are tags (known: ``cpu-only``); ``apply --exclude-tag cpu-only`` leaves those
patches out (GPU images), ``check`` verifies the series with and without them. Paths inside a patch are
relative to the site-packages dir that holds the distribution
(``a/speculators/train/trainer.py``) and are applied with ``git apply -p1``.

Commands (stdlib only, python3 >= 3.10):

  apply.py apply --dist speculators [--site DIR] [--record FILE] [--python EXE] [--dry-run] [--exclude-tag TAG]
  apply.py status --dist speculators [--site DIR] [--exclude-tag TAG]
  apply.py check --dist speculators --version 0.9.0 [--wheel PATH]
  apply.py check --all
  apply.py hash --dist speculators --version 0.9.0

Exit codes: 0 ok; 1 a patch does not apply / check failed; 2 no series for the
installed version, distribution not found, or bad usage.

The same file is imported by path by the pipeline (run manifests):
``series_sha256(dist, version)``, ``apply_series(...)``, ``series_status(...)``.

Guarantees:
* zero fuzz: ``git apply`` never fuzzes, ``-C``/``--ignore-whitespace`` are never
  passed; a drifted context line is a hard failure.
* all-or-nothing: the whole series is first applied to a scratch copy of the
  touched files; the real site dir is only modified when every patch applied
  (or was already applied) there.
* ``git apply`` runs with cwd=<site> and GIT_CEILING_DIRECTORIES=<parent of
  site> (and GIT_DIR & co. removed from the environment). Without that, a site
  dir inside a git work tree (e.g. a .venv under a checkout) makes
  ``git apply`` print "Skipped patch ..." and exit 0 without changing anything.
* idempotent: a patch whose reverse applies cleanly is reported
  ``already-applied`` and skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PATCHES_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PATCHES_ROOT.parent

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_NO_SERIES = 2

# Environment variables that would make git ignore the cwd-based discovery that
# GIT_CEILING_DIRECTORIES bounds (or redirect it to some other repository).
_GIT_ENV_DROP = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_COMMON_DIR",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
)


class PatchError(Exception):
    """A failure with an exit code and a message meant for the user."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------
# Series files
# --------------------------------------------------------------------------


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def series_dir(dist: str, version: str, root: Path | None = None) -> Path:
    return Path(root or PATCHES_ROOT) / dist / version


def available_series(dist: str | None = None, root: Path | None = None) -> list[tuple[str, str]]:
    """All (dist, version) pairs that have a series file, sorted."""
    root = Path(root or PATCHES_ROOT)
    out = []
    for s in sorted(root.glob("*/*/series")):
        d, v = s.parent.parent.name, s.parent.name
        if dist is None or canonical_name(d) == canonical_name(dist):
            out.append((d, v))
    return out


def _no_series_error(dist: str, version: str, root: Path | None = None) -> PatchError:
    existing = available_series(dist, root)
    where = series_dir(dist, version, root)
    have = ", ".join(f"{d}/{v}" for d, v in existing) or "none"
    return PatchError(
        f"no patch series for {dist}=={version}: {where}/series does not exist "
        f"(existing series dirs for {dist}: {have}). Refusing to continue: "
        f"{dist} {version} was not reviewed for these patches; add "
        f"patches/{dist}/{version}/series (possibly empty) after checking it.",
        EXIT_NO_SERIES,
    )


# Tags a series line may carry after the patch file name. "cpu-only": needed only where vLLM runs
# on CPU; images for GPUs leave such patches out (apply --exclude-tag cpu-only).
KNOWN_TAGS = frozenset({"cpu-only"})


def read_series_entries(dist: str, version: str, root: Path | None = None) -> list[tuple[Path, frozenset[str]]]:
    """(patch path, tags) of a series, in order. Raises PatchError(exit 2) if absent."""
    sdir = series_dir(dist, version, root)
    sfile = sdir / "series"
    if not sfile.is_file():
        raise _no_series_error(dist, version, root)
    entries = []
    for lineno, raw in enumerate(sfile.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *tags = line.split()
        p = sdir / name
        if "/" in name or not p.is_file():
            raise PatchError(f"{sfile}:{lineno}: patch file {name!r} not found next to the series file")
        unknown = sorted(set(tags) - KNOWN_TAGS)
        if unknown:
            raise PatchError(f"{sfile}:{lineno}: unknown tag(s) {unknown} (known: {sorted(KNOWN_TAGS)})")
        entries.append((p, frozenset(tags)))
    return entries


def read_series(dist: str, version: str, root: Path | None = None, exclude_tags=()) -> list[Path]:
    """Patch paths of a series, in order, without those carrying a tag in exclude_tags.
    Raises PatchError(exit 2) if absent."""
    unknown = sorted(set(exclude_tags) - KNOWN_TAGS)
    if unknown:
        raise PatchError(f"unknown tag(s) {unknown} (known: {sorted(KNOWN_TAGS)})", EXIT_NO_SERIES)
    return [p for p, tags in read_series_entries(dist, version, root) if not tags & set(exclude_tags)]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def series_sha256(dist: str, version: str, root: Path | None = None) -> str:
    """sha256 over the bytes of the series file followed by the bytes of every
    patch file, in series order (plain concatenation)."""
    patches = read_series(dist, version, root)  # raises PatchError(2) if missing
    h = hashlib.sha256()
    h.update((series_dir(dist, version, root) / "series").read_bytes())
    for p in patches:
        h.update(p.read_bytes())
    return h.hexdigest()


_PLUS_RE = re.compile(r"^\+\+\+ (?:b/)?(\S+)")
_MINUS_RE = re.compile(r"^--- (?:a/)?(\S+)")


def patch_files(patch: Path) -> list[str]:
    """Relative paths (after -p1) that a patch touches, in order of appearance."""
    files: list[str] = []
    old = None
    for line in Path(patch).read_text().splitlines():
        m = _MINUS_RE.match(line)
        if m:
            old = m.group(1)
            continue
        m = _PLUS_RE.match(line)
        if m:
            new = m.group(1)
            rel = old if new == "/dev/null" else new
            if rel and rel != "/dev/null" and rel not in files:
                files.append(rel)
            old = None
    return files


def series_files(patches: list[Path]) -> list[str]:
    out: list[str] = []
    for p in patches:
        for f in patch_files(p):
            if f not in out:
                out.append(f)
    return out


# --------------------------------------------------------------------------
# Locating the installed distribution
# --------------------------------------------------------------------------


def find_installed(dist: str, site: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(site dir, version) of an installed distribution.

    With ``site``: the distribution must be in exactly that directory.
    Without: the one importable by the running interpreter.
    """
    import importlib.metadata as md

    want = canonical_name(dist)
    if site is not None:
        site_p = Path(site).resolve()
        if not site_p.is_dir():
            raise PatchError(f"--site {site} is not a directory", EXIT_NO_SERIES)
        found = [d for d in md.distributions(path=[str(site_p)]) if canonical_name(d.metadata["Name"] or "") == want]
        if not found:
            raise PatchError(f"distribution {dist!r} is not installed in {site_p}", EXIT_NO_SERIES)
        if len({d.version for d in found}) > 1:
            raise PatchError(
                f"several {dist} dist-info dirs in {site_p}: {sorted(d.version for d in found)}",
                EXIT_NO_SERIES,
            )
        return site_p, found[0].version
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        raise PatchError(
            f"distribution {dist!r} is not installed for {sys.executable}; pass --site DIR",
            EXIT_NO_SERIES,
        ) from None
    return Path(d.locate_file("")).resolve(), d.version


# --------------------------------------------------------------------------
# git apply
# --------------------------------------------------------------------------


def _git_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_DROP}
    env["GIT_CEILING_DIRECTORIES"] = str(Path(site).resolve().parent)
    env["LC_ALL"] = "C"
    return env


def git_apply(site: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run ``git apply -p1 [extra] <abs patch>`` with cwd=site. Never fuzzes."""
    if shutil.which("git") is None:
        raise PatchError("git is required to apply patches (git apply) but was not found on PATH")
    cmd = ["git", "apply", "-p1", "--verbose", *extra, str(Path(patch).resolve())]
    return subprocess.run(
        cmd,
        cwd=str(site),
        env=_git_env(site),
        capture_output=True,
        text=True,
        check=False,
    )


def _git_said(proc: subprocess.CompletedProcess) -> str:
    """git's own words (which file, which line, the hunk context it looked for)."""
    lines = [
        "    " + line
        for line in (proc.stderr + proc.stdout).splitlines()
        if line.strip() and not line.startswith("Checking patch")
    ]
    return "\n".join(lines) or "    (git printed nothing)"


def _skipped(proc: subprocess.CompletedProcess) -> bool:
    return "Skipped patch" in proc.stderr or "Skipped patch" in proc.stdout


def patch_state(site: Path, patch: Path) -> tuple[str, str]:
    """Classify one patch against the tree as it is now.

    Returns (state, git message): state is one of ``applied`` (reverse applies,
    forward does not), ``pending`` (forward applies, reverse does not),
    ``conflict`` (neither) or ``ambiguous`` (both).
    """
    rev = git_apply(site, patch, "--check", "-R")
    fwd = git_apply(site, patch, "--check")
    for proc in (rev, fwd):
        if _skipped(proc):
            raise PatchError(
                f"git skipped {patch.name} in {site} (git work-tree confusion):\n{_git_said(proc)}"
            )
    r, f = rev.returncode == 0, fwd.returncode == 0
    if r and not f:
        return "applied", ""
    if f and not r:
        return "pending", ""
    if r and f:
        return "ambiguous", "both the patch and its reverse apply cleanly"
    return "conflict", _git_said(fwd)


# --------------------------------------------------------------------------
# Applying a series
# --------------------------------------------------------------------------


@dataclass
class PatchResult:
    name: str
    sha256: str
    status: str  # applied | already-applied | conflict | not-attempted | ambiguous
    message: str = ""


@dataclass
class SeriesResult:
    dist: str
    version: str
    site: Path
    series_sha256: str
    patches: list[PatchResult] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    excluded: list[str] = field(default_factory=list)  # left out by exclude_tags

    def record(self) -> dict:
        return {
            "dist": self.dist,
            "version": self.version,
            "series_sha256": self.series_sha256,
            "patches": [{"name": p.name, "sha256": p.sha256, "status": p.status} for p in self.patches],
            "files": dict(sorted(self.files.items())),
            **({"excluded": list(self.excluded)} if self.excluded else {}),
        }

    def summary(self) -> str:
        n_app = sum(p.status == "applied" for p in self.patches)
        n_already = sum(p.status == "already-applied" for p in self.patches)
        head = f"{self.dist}=={self.version} series {self.series_sha256[:12]} at {self.site}"
        if not self.ok:
            return f"FAILED {head}: {self.error}"
        if not self.patches:
            return f"OK {head}: empty series, nothing to do"
        if n_already == len(self.patches):
            state = "already fully applied, nothing changed"
        elif n_already:
            state = f"was PARTIALLY applied ({n_already} already-applied), now completed ({n_app} applied)"
        else:
            state = f"{n_app} applied"
        left_out = f", {len(self.excluded)} excluded by tag" if self.excluded else ""
        return f"OK {head}: {len(self.patches)} patches, {state}{left_out}"


def series_status(dist: str, site: str | os.PathLike | None = None, version: str | None = None,
                  root: Path | None = None, exclude_tags=()) -> list[tuple[str, str, str]]:
    """Per-patch (name, state, git message) of the series against the tree as-is,
    each patch judged independently (patch_state); patches with an excluded tag are left out."""
    site_p, inst_version = find_installed(dist, site) if version is None else (Path(site).resolve(), version)
    patches = read_series(dist, inst_version, root, exclude_tags)
    return [(p.name, *patch_state(site_p, p)) for p in patches]


def _describe_states(states: list[tuple[str, str, str]]) -> str:
    kinds = {s for _, s, _ in states}
    if kinds <= {"applied"}:
        overall = "fully applied"
    elif kinds <= {"pending"}:
        overall = "not applied"
    elif kinds <= {"applied", "pending"}:
        overall = "PARTIALLY applied"
    else:
        overall = "PARTIALLY applied / CONFLICTING" if "applied" in kinds else "CONFLICTING"
    lines = [f"series state: {overall}"]
    for name, st, _ in states:
        lines.append(f"  {name}: {st}")
    return "\n".join(lines)


def _copy_rel(src_root: Path, dst_root: Path, rels: list[str]) -> None:
    for rel in rels:
        s = src_root / rel
        if s.exists():
            d = dst_root / rel
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)


def _run_series(tree: Path, patches: list[Path]) -> tuple[list[PatchResult], str]:
    """Apply a series in order to `tree`. Stops at the first failure.

    Returns (results, error); results has one entry per patch (patches after a
    failure are 'not-attempted')."""
    results: list[PatchResult] = []
    error = ""
    for i, p in enumerate(patches):
        digest = sha256_file(p)
        state, msg = patch_state(tree, p)
        if state == "applied":
            results.append(PatchResult(p.name, digest, "already-applied"))
            continue
        if state == "pending":
            proc = git_apply(tree, p)
            if proc.returncode != 0 or _skipped(proc):
                error = f"patch {p.name} passed --check but git apply failed:\n{_git_said(proc)}"
                results.append(PatchResult(p.name, digest, "conflict", error))
            else:
                results.append(PatchResult(p.name, digest, "applied"))
                continue
        else:
            files = ", ".join(patch_files(p))
            if state == "ambiguous":
                error = f"patch {p.name} ({files}): {msg}; cannot tell whether it is applied"
            else:
                error = f"patch {p.name} does not apply to {files} (and is not already applied); git apply says:\n{msg}"
            results.append(PatchResult(p.name, digest, state, error))
        for q in patches[i + 1:]:
            results.append(PatchResult(q.name, sha256_file(q), "not-attempted"))
        break
    return results, error


def _byte_compile(site: Path, rels: list[str], python: str | None) -> None:
    """Drop every cached .pyc of the patched files (any interpreter tag) and
    recompile them, so a stale .pyc cannot hide a change."""
    py_rels = [r for r in rels if r.endswith(".py")]
    for rel in py_rels:
        src = site / rel
        cache = src.parent / "__pycache__"
        if cache.is_dir():
            for pyc in cache.glob(src.stem + ".*.pyc"):
                pyc.unlink()
    if not py_rels:
        return
    srcs = [str(site / r) for r in py_rels]
    if python and Path(python).resolve() != Path(sys.executable).resolve():
        proc = subprocess.run([python, "-m", "py_compile", *srcs], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise PatchError(f"byte-compiling patched files with {python} failed:\n{proc.stderr}")
    else:
        for s in srcs:
            try:
                py_compile.compile(s, doraise=True)
            except py_compile.PyCompileError as e:
                raise PatchError(f"byte-compiling {s} failed: {e}") from e


def _guess_python(site: Path) -> str | None:
    """The interpreter of a venv whose site-packages is `site` (…/lib/pythonX.Y/site-packages)."""
    if site.name == "site-packages" and site.parent.name.startswith("python"):
        for cand in (site.parent.parent.parent / "bin" / site.parent.name, site.parent.parent.parent / "bin" / "python"):
            if cand.exists():
                return str(cand)
    return None


def apply_series(dist: str, site: str | os.PathLike | None = None, *, version: str | None = None,
                 root: Path | None = None, python: str | None = None, dry_run: bool = False,
                 compile_pyc: bool = True, exclude_tags=()) -> SeriesResult:
    """Apply patches/<dist>/<installed version>/series to the installed files.

    All-or-nothing: the series is first run on a scratch copy of the touched
    files; the site dir is only changed if every patch applies or is already
    applied. Raises PatchError(exit 2) when no series exists for the version.
    Patches tagged with one of exclude_tags are left out (listed in .excluded).
    Returns a SeriesResult (ok=False with per-patch statuses on failure).
    """
    if version is None:
        site_p, version = find_installed(dist, site)
    else:
        if site is None:
            raise PatchError("version given without site")
        site_p = Path(site).resolve()
    patches = read_series(dist, version, root, exclude_tags)
    res = SeriesResult(dist, version, site_p, series_sha256(dist, version, root))
    res.excluded = [p.name for p in read_series(dist, version, root) if p not in patches]
    rels = series_files(patches)
    missing = [r for r in rels if not (site_p / r).is_file()]
    if missing:
        res.ok = False
        res.error = f"files the series patches are missing in {site_p}: {missing}"
        res.patches = [PatchResult(p.name, sha256_file(p), "not-attempted") for p in patches]
        return res

    # 1) dry run on a scratch copy of the touched files
    with tempfile.TemporaryDirectory(prefix="patch-stage-") as tmp:
        stage = Path(tmp) / "site"
        stage.mkdir()
        _copy_rel(site_p, stage, rels)
        results, error = _run_series(stage, patches)
        staged = {r: sha256_file(stage / r) for r in rels}
    res.patches = results
    if error:
        res.ok = False
        states = [(p.name, *patch_state(site_p, p)) for p in patches]
        res.error = f"nothing was changed in {site_p}.\n{error}\n{_describe_states(states)}"
        return res
    if dry_run:
        res.files = staged
        return res

    # 2) the real thing, same operations on the same bytes
    for p, r in zip(patches, results):
        if r.status != "applied":
            continue
        chk = git_apply(site_p, p, "--check")
        if chk.returncode != 0 or _skipped(chk):
            res.ok = False
            res.error = f"patch {p.name} applied on the scratch copy but not in {site_p}:\n{_git_said(chk)}"
            return res
        proc = git_apply(site_p, p)
        if proc.returncode != 0 or _skipped(proc):
            res.ok = False
            res.error = f"git apply {p.name} failed in {site_p}:\n{_git_said(proc)}"
            return res
    res.files = {r: sha256_file(site_p / r) for r in rels}
    if res.files != staged:
        res.ok = False
        res.error = "patched files differ from the scratch-copy result (concurrent modification?)"
        return res
    if compile_pyc and any(r.status == "applied" for r in results):
        _byte_compile(site_p, rels, python or _guess_python(site_p))
    return res


# --------------------------------------------------------------------------
# patch-check against the pristine wheel
# --------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("PATCHES_CACHE_DIR") or (REPO_ROOT / ".cache"))


def find_or_download_wheel(dist: str, version: str, wheel: str | None = None) -> Path:
    if wheel:
        p = Path(wheel)
        if not p.is_file():
            raise PatchError(f"--wheel {wheel} does not exist")
        return p
    wheels = cache_dir() / "wheels"
    prefix = f"{canonical_name(dist).replace('-', '_')}-{version}-"
    for cand in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        if cand.name.lower().startswith(prefix.lower()):
            return cand
    wheels.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("PIP_CACHE_DIR", str(cache_dir() / "pip"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{dist}=={version}", "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise PatchError(f"could not download the pristine wheel {dist}=={version}:\n{proc.stderr[-2000:]}")
    for cand in sorted(wheels.glob("*.whl")):
        if cand.name.lower().startswith(prefix.lower()):
            return cand
    raise PatchError(f"pip download succeeded but no {prefix}*.whl in {wheels}")


def check_series(dist: str, version: str, wheel: str | None = None, root: Path | None = None,
                 out=print) -> bool:
    """Apply the series to a pristine unpacked wheel; report per patch; then
    re-apply to confirm every patch is detected as already-applied."""
    patches = read_series(dist, version, root)  # exit 2 if absent
    whl = find_or_download_wheel(dist, version, wheel)
    tmp_root = cache_dir() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="patch-check-", dir=tmp_root) as tmp:
        site = Path(tmp) / "site"
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(site)
        out(f"patch-check {dist}=={version}: wheel {whl.name} sha256 {sha256_file(whl)}")
        res = apply_series(dist, site, root=root, compile_pyc=False)
        if res.version != version:
            out(f"  FAIL: wheel {whl.name} contains {dist} {res.version}, not {version}")
            return False
        for p in res.patches:
            ok = p.status == "applied"
            out(f"  {'OK  ' if ok else 'FAIL'} {p.name} ({p.status})")
            if p.message:
                out("\n".join("       " + line for line in p.message.splitlines()))
        if not res.ok:
            out(f"  FAIL: {res.error.splitlines()[0]}")
            return False
        again = apply_series(dist, site, root=root, compile_pyc=False)
        if not again.ok or any(p.status != "already-applied" for p in again.patches):
            out("  FAIL: re-applying did not report every patch as already-applied:")
            for p in again.patches:
                out(f"       {p.name}: {p.status}")
            return False
        tags = sorted({t for _, ts in read_series_entries(dist, version, root) for t in ts})
        for tag in tags:  # e.g. GPU images apply the series without its cpu-only patches
            site2 = Path(tmp) / f"site-without-{tag}"
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(site2)
            res2 = apply_series(dist, site2, root=root, compile_pyc=False, exclude_tags=[tag])
            if not res2.ok:
                out(f"  FAIL: without the '{tag}' patches the series does not apply: {res2.error.splitlines()[0]}")
                return False
            out(f"  OK   without the '{tag}' patches ({', '.join(res2.excluded)}): {len(res2.patches)} patches apply")
        for rel, digest in sorted(res.files.items()):
            out(f"  file {rel} sha256 {digest}")
        out(f"  series_sha256 {res.series_sha256}")
        out(f"OK patch-check {dist}=={version}: {len(res.patches)} patches apply with zero fuzz to the pristine wheel")
        return True


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _cmd_apply(a: argparse.Namespace) -> int:
    res = apply_series(a.dist, a.site, python=a.python, dry_run=a.dry_run, exclude_tags=a.exclude_tag)
    for p in res.patches:
        print(f"  {p.name}: {p.status}")
    if not res.ok:
        print(res.summary().splitlines()[0], file=sys.stderr)
        print("\n".join(res.error.splitlines()[1:]), file=sys.stderr)
        return EXIT_FAIL
    if a.record and not a.dry_run:
        Path(a.record).parent.mkdir(parents=True, exist_ok=True)
        Path(a.record).write_text(json.dumps(res.record(), indent=2, sort_keys=False) + "\n")
    print(("DRY-RUN " if a.dry_run else "") + res.summary())
    return EXIT_OK


def _cmd_status(a: argparse.Namespace) -> int:
    site_p, version = find_installed(a.dist, a.site)
    states = series_status(a.dist, site_p, version=version, exclude_tags=a.exclude_tag)
    print(f"{a.dist}=={version} at {site_p}")
    print(_describe_states(states))
    for name, st, msg in states:
        if msg:
            print(f"  {name}:\n{msg}")
    return EXIT_OK if all(s == "applied" for _, s, _ in states) else EXIT_FAIL


def _cmd_check(a: argparse.Namespace) -> int:
    if a.all:
        targets = available_series()
        if not targets:
            print("no series under", PATCHES_ROOT)
            return EXIT_OK
    else:
        if not (a.dist and a.version):
            raise PatchError("check needs --dist and --version, or --all", EXIT_NO_SERIES)
        targets = [(a.dist, a.version)]
    ok = True
    for d, v in targets:
        try:
            ok = check_series(d, v, a.wheel) and ok
        except PatchError as e:
            print(f"FAIL patch-check {d}=={v}: {e}", file=sys.stderr)
            if e.code == EXIT_NO_SERIES and not a.all:
                return EXIT_NO_SERIES
            ok = False
    return EXIT_OK if ok else EXIT_FAIL


def _cmd_hash(a: argparse.Namespace) -> int:
    print(series_sha256(a.dist, a.version))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="apply.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("apply", help="apply the series for the installed version")
    p.add_argument("--dist", required=True)
    p.add_argument("--site", help="site-packages dir holding the distribution (default: the running interpreter's)")
    p.add_argument("--record", help="write a JSON record of what was applied")
    p.add_argument("--python", help="interpreter used to byte-compile patched files "
                   "(default: <venv>/bin/pythonX.Y guessed from --site, else this one)")
    p.add_argument("--dry-run", action="store_true", help="only apply to a scratch copy and report")
    p.add_argument("--exclude-tag", action="append", default=[], metavar="TAG",
                   help="leave out the patches tagged TAG in the series (GPU images: cpu-only)")
    p.set_defaults(fn=_cmd_apply)

    p = sub.add_parser("status", help="report per patch: applied / pending / conflict")
    p.add_argument("--dist", required=True)
    p.add_argument("--site")
    p.add_argument("--exclude-tag", action="append", default=[], metavar="TAG")
    p.set_defaults(fn=_cmd_status)

    p = sub.add_parser("check", help="apply the series to the pristine wheel (patch-check)")
    p.add_argument("--dist")
    p.add_argument("--version")
    p.add_argument("--wheel", help="pristine wheel (default: .cache/wheels/, else pip download into it)")
    p.add_argument("--all", action="store_true", help="check every patches/<dist>/<version>/series")
    p.set_defaults(fn=_cmd_check)

    p = sub.add_parser("hash", help="print series_sha256")
    p.add_argument("--dist", required=True)
    p.add_argument("--version", required=True)
    p.set_defaults(fn=_cmd_hash)

    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except PatchError as e:
        print(f"apply.py {a.cmd}: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
