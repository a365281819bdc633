"""Tests for patches/apply.py and the speculators 0.9.0 CPU patch series.

Run with the repo's venv: `.venv/bin/python -m pytest tests/test_patches.py`.
No network: the pristine files come from the wheel in .cache/wheels when it is
there, else from the installed files with the series reverse-applied; either
way they are verified against the sha256s in the installed dist-info RECORD
(which apply.py never rewrites, so it keeps describing the pristine wheel).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "patches" / "apply.py"
DIST = "speculators"
VERSION = "0.9.0"


def _load_apply():
    spec = importlib.util.spec_from_file_location("patches_apply", APPLY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ap = _load_apply()
PATCHES = ap.read_series(DIST, VERSION)
FILES = ap.series_files(PATCHES)


# ---------------------------------------------------------------------------
# helpers / fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed():
    site, version = ap.find_installed(DIST)
    if version != VERSION:
        pytest.fail(f"tests expect {DIST}=={VERSION} installed, found {version} in {site}")
    dist_info = site / f"{DIST}-{VERSION}.dist-info"
    assert (dist_info / "RECORD").is_file(), dist_info
    return site, dist_info


def _record_hashes(dist_info: Path) -> dict[str, str]:
    out = {}
    for line in (dist_info / "RECORD").read_text().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            b64 = parts[1][len("sha256="):]
            out[parts[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return out


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(root)): (_sha(p), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _cached_wheel() -> Path | None:
    wheels = REPO / ".cache" / "wheels"
    cands = sorted(wheels.glob(f"{DIST}-{VERSION}-*.whl")) if wheels.is_dir() else []
    return cands[0] if cands else None


def make_pristine_site(dest: Path, installed) -> Path:
    """dest/ <- pristine copies of the files the series touches + the dist-info."""
    site, dist_info = installed
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(dist_info, dest / dist_info.name)
    whl = _cached_wheel()
    if whl is not None:
        with zipfile.ZipFile(whl) as zf:
            for rel in FILES:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(zf.read(rel))
    else:
        for rel in FILES:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, dest / rel)
        record = _record_hashes(dist_info)
        if any(_sha(dest / rel) != record[rel] for rel in FILES):
            for p in reversed(PATCHES):
                proc = ap.git_apply(dest, p, "-R")
                assert proc.returncode == 0, proc.stderr
    record = _record_hashes(dist_info)
    for rel in FILES:
        assert _sha(dest / rel) == record[rel], f"pristine {rel} does not match the dist-info RECORD"
    return dest


def run_apply(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(APPLY), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


# ---------------------------------------------------------------------------
# (a) pristine + series == installed bytes (image build and local setup agree)
# ---------------------------------------------------------------------------


def test_installed_venv_is_fully_patched(installed):
    site, _ = installed
    states = ap.series_status(DIST, site)
    assert [s for _, s, _ in states] == ["applied"] * len(PATCHES), (
        f"{site} is not fully patched: {states}; run `python patches/apply.py apply "
        f"--dist {DIST} --site {site}`"
    )


def test_series_applies_to_pristine_and_matches_installed_bytes(work, installed):
    site, _ = installed
    tree = make_pristine_site(work / "site", installed)
    rec = work / "record.json"
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree), "--record", str(rec))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(rec.read_text())
    assert data["dist"] == DIST and data["version"] == VERSION
    assert data["series_sha256"] == ap.series_sha256(DIST, VERSION)
    assert [p["name"] for p in data["patches"]] == [p.name for p in PATCHES]
    assert all(p["status"] == "applied" for p in data["patches"]), data["patches"]
    assert [p["sha256"] for p in data["patches"]] == [_sha(p) for p in PATCHES]
    assert sorted(data["files"]) == sorted(FILES)
    for rel in FILES:
        assert (tree / rel).read_bytes() == (site / rel).read_bytes(), (
            f"{rel}: pristine+series differs from the installed file"
        )
        assert data["files"][rel] == _sha(site / rel)
    # patched files were byte-compiled
    for rel in FILES:
        src = tree / rel
        assert list((src.parent / "__pycache__").glob(src.stem + ".*.pyc")), rel


def test_every_patch_has_dep3_header_and_no_overlap(installed):
    for p in PATCHES:
        head = p.read_text().split("\ndiff --git ", 1)[0]
        for key in ("Subject:", "What:", "Why:", "Upstream:", f"Applies-to: {DIST}=={VERSION}"):
            assert re.search(rf"^{re.escape(key)}", head, re.M), f"{p.name}: header lacks {key!r}"
    # each patch is detected on its own in both pristine and fully patched trees
    # (what the applied/pending/partial reporting relies on)
    site, _ = installed
    for p in PATCHES:
        assert ap.patch_state(site, p)[0] == "applied", p.name


def test_check_command_against_cached_wheel():
    whl = _cached_wheel()
    if whl is None:
        pytest.skip("no pristine wheel in .cache/wheels (patch-check would download it)")
    proc = run_apply("check", "--dist", DIST, "--version", VERSION, "--wheel", str(whl))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for p in PATCHES:
        assert f"OK   {p.name}" in proc.stdout
    assert ap.series_sha256(DIST, VERSION) in proc.stdout


# ---------------------------------------------------------------------------
# (b) drifted context -> loud failure naming patch and file, tree unchanged
# ---------------------------------------------------------------------------


def _drift(tree: Path) -> None:
    """Change one *context* line of 0002 (not a line any patch changes)."""
    f = tree / "speculators/train/trainer.py"
    text = f.read_text()
    old = "        self.resume_from_checkpoint = config.resume_from_checkpoint\n"
    assert text.count(old) == 1
    f.write_text(text.replace(old, "        self.resume_from_checkpoint = bool(config.resume_from_checkpoint)\n"))


def test_drifted_context_fails_and_changes_nothing(work, installed):
    tree = make_pristine_site(work / "site", installed)
    _drift(tree)
    before = _snapshot(tree)
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree), "--record", str(work / "r.json"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "0002-cpu-autocast-device-type.patch" in proc.stderr
    assert "speculators/train/trainer.py" in proc.stderr
    assert "patch does not apply" in proc.stderr or "patch failed" in proc.stderr  # git's words
    assert "nothing was changed" in proc.stderr
    # all-or-nothing: 0001 would apply, but the site is untouched
    assert _snapshot(tree) == before
    assert not (work / "r.json").exists()


def test_partially_applied_and_conflicting_series_is_reported(work, installed):
    tree = make_pristine_site(work / "site", installed)
    assert ap.git_apply(tree, PATCHES[0]).returncode == 0  # 0001 applied by hand
    _drift(tree)  # 0002 conflicts
    before = _snapshot(tree)
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree))
    assert proc.returncode == 1
    assert "PARTIALLY applied / CONFLICTING" in proc.stderr
    assert f"{PATCHES[0].name}: applied" in proc.stderr
    assert f"{PATCHES[1].name}: conflict" in proc.stderr
    assert f"{PATCHES[2].name}: pending" in proc.stderr
    assert _snapshot(tree) == before

    # without the conflict, a half-applied series is completed and said so
    tree2 = make_pristine_site(work / "site2", installed)
    assert ap.git_apply(tree2, PATCHES[0]).returncode == 0
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree2))
    assert proc.returncode == 0, proc.stderr
    assert "PARTIALLY applied" in proc.stdout
    assert f"{PATCHES[0].name}: already-applied" in proc.stdout
    site, _ = installed
    for rel in FILES:
        assert (tree2 / rel).read_bytes() == (site / rel).read_bytes()


# ---------------------------------------------------------------------------
# (c) idempotent
# ---------------------------------------------------------------------------


def test_applying_twice_reports_already_applied_and_changes_nothing(work, installed):
    tree = make_pristine_site(work / "site", installed)
    assert run_apply("apply", "--dist", DIST, "--site", str(tree)).returncode == 0
    before = _snapshot(tree)
    rec = work / "again.json"
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree), "--record", str(rec))
    assert proc.returncode == 0, proc.stderr
    assert "already fully applied" in proc.stdout
    assert _snapshot(tree) == before  # bytes and mtimes, .pyc included
    data = json.loads(rec.read_text())
    assert [p["status"] for p in data["patches"]] == ["already-applied"] * len(PATCHES)


# ---------------------------------------------------------------------------
# (d) no series for the installed version -> exit 2 naming the version
# ---------------------------------------------------------------------------


def test_version_without_series_exits_2(work, installed):
    _, dist_info = installed
    tree = work / "site"
    (tree / "speculators").mkdir(parents=True)
    di = tree / f"{DIST}-0.0.1.dist-info"
    shutil.copytree(dist_info, di)
    meta = di / "METADATA"
    meta.write_text(re.sub(r"^Version: .*$", "Version: 0.0.1", meta.read_text(), count=1, flags=re.M))
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "0.0.1" in proc.stderr
    assert f"{DIST}/{VERSION}" in proc.stderr  # names the series dirs that exist
    assert run_apply("hash", "--dist", DIST, "--version", "0.0.1").returncode == 2
    with pytest.raises(ap.PatchError) as ei:
        ap.series_sha256(DIST, "0.0.1")
    assert ei.value.code == 2


# ---------------------------------------------------------------------------
# (e) a git work tree around the site dir must not make git apply skip
# ---------------------------------------------------------------------------


def test_git_work_tree_around_site_does_not_skip(work, installed):
    site, _ = installed
    repo = work / "checkout"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.venv/\n")
    tree = make_pristine_site(repo / ".venv" / "lib" / "python3.11" / "site-packages", installed)

    # the pitfall is real here: plain git apply "succeeds" and changes nothing
    before = _snapshot(tree)
    plain = subprocess.run(
        ["git", "apply", "-v", "-p1", str(PATCHES[0])], cwd=tree, capture_output=True, text=True, check=False
    )
    assert plain.returncode == 0 and "Skipped patch" in plain.stderr
    assert _snapshot(tree) == before
    assert ap.patch_state(tree, PATCHES[0])[0] == "pending"

    # even a stray GIT_DIR/GIT_WORK_TREE pointing at the checkout must not matter
    env = dict(os.environ, GIT_DIR=str(repo / ".git"), GIT_WORK_TREE=str(repo))
    proc = run_apply("apply", "--dist", DIST, "--site", str(tree), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 applied" in proc.stdout or f"{len(PATCHES)} applied" in proc.stdout
    for rel in FILES:
        assert (tree / rel).read_bytes() == (site / rel).read_bytes(), rel


# ---------------------------------------------------------------------------
# importable API used by run manifests
# ---------------------------------------------------------------------------


def test_series_sha256_api_matches_cli_and_definition():
    h = hashlib.sha256((REPO / "patches" / DIST / VERSION / "series").read_bytes())
    for p in PATCHES:
        h.update(p.read_bytes())
    assert ap.series_sha256(DIST, VERSION) == h.hexdigest()
    proc = run_apply("hash", "--dist", DIST, "--version", VERSION)
    assert proc.returncode == 0 and proc.stdout.strip() == h.hexdigest()


# ---------------------------------------------------------------------------
# series tags: `name.patch cpu-only` in a series; apply --exclude-tag leaves them out
# ---------------------------------------------------------------------------


def _demo_series(work: Path, series_text: str) -> tuple[Path, Path]:
    """A tiny distribution 'demo' 1.0 in work/site and a patch root with two patches."""
    site = work / "site"
    (site / "demo").mkdir(parents=True)
    di = site / "demo-1.0.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    body = "".join(f"line {i}\n" for i in range(20))
    (site / "demo" / "a.py").write_text(body)
    root = work / "patches"
    sdir = root / "demo" / "1.0"
    sdir.mkdir(parents=True)
    stage = work / "stage"
    for name, old, new in (("0001-cpu.patch", "line 2\n", "line 2 cpu\n"), ("0002-all.patch", "line 15\n", "line 15 all\n")):
        (stage / "a" / "demo").mkdir(parents=True, exist_ok=True)
        (stage / "b" / "demo").mkdir(parents=True, exist_ok=True)
        (stage / "a" / "demo" / "a.py").write_text(body)
        (stage / "b" / "demo" / "a.py").write_text(body.replace(old, new))
        diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a/demo/a.py", "b/demo/a.py"],
                              cwd=stage, capture_output=True, text=True, check=False).stdout
        (sdir / name).write_text(f"Subject: {name}\n\n" + diff)
    (sdir / "series").write_text(series_text)
    return site, root


def test_tagged_patches_can_be_excluded(work):
    site, root = _demo_series(work, "# demo\n0001-cpu.patch cpu-only\n0002-all.patch\n")
    assert [p.name for p in ap.read_series("demo", "1.0", root)] == ["0001-cpu.patch", "0002-all.patch"]
    assert [p.name for p in ap.read_series("demo", "1.0", root, exclude_tags=["cpu-only"])] == ["0002-all.patch"]

    res = ap.apply_series("demo", site, root=root, exclude_tags=["cpu-only"], compile_pyc=False)
    assert res.ok, res.error
    assert [p.name for p in res.patches] == ["0002-all.patch"] and res.excluded == ["0001-cpu.patch"]
    assert res.record()["excluded"] == ["0001-cpu.patch"] and "1 excluded by tag" in res.summary()
    text = (site / "demo" / "a.py").read_text()
    assert "line 15 all\n" in text and "line 2 cpu\n" not in text
    assert dict((n, s) for n, s, _ in ap.series_status("demo", site, root=root)) == {
        "0001-cpu.patch": "pending", "0002-all.patch": "applied"}
    assert [s for _, s, _ in ap.series_status("demo", site, root=root, exclude_tags=["cpu-only"])] == ["applied"]

    # without exclusion the rest of the series is completed; the series hash covers every patch
    res = ap.apply_series("demo", site, root=root, compile_pyc=False)
    assert res.ok and [p.status for p in res.patches] == ["applied", "already-applied"] and not res.excluded
    assert "line 2 cpu\n" in (site / "demo" / "a.py").read_text()
    assert ap.series_sha256("demo", "1.0", root) == hashlib.sha256(
        b"".join((root / "demo" / "1.0" / f).read_bytes() for f in ("series", "0001-cpu.patch", "0002-all.patch"))).hexdigest()


def test_unknown_series_tag_is_an_error(work):
    _, root = _demo_series(work, "0001-cpu.patch cpu_only\n0002-all.patch\n")
    with pytest.raises(ap.PatchError) as ei:
        ap.read_series("demo", "1.0", root)
    assert "cpu_only" in str(ei.value) and "cpu-only" in str(ei.value)
    with pytest.raises(ap.PatchError) as ei:
        ap.read_series(DIST, VERSION, exclude_tags=["gpu-only"])
    assert ei.value.code == 2
    proc = run_apply("status", "--dist", DIST, "--exclude-tag", "nonsense")
    assert proc.returncode == 2 and "nonsense" in proc.stderr


def test_train_refuses_a_speculators_without_the_series(work, installed, monkeypatch):
    """The train step's check (pipeline.manifest.require_patched_speculators): a pristine wheel is refused, naming
    what is missing and the command that fixes it; the patched one passes; patches an image's record excluded (for
    this version) are not required; no git is a clear refusal; the opt-out runs and records the gap."""
    monkeypatch.syspath_prepend(str(REPO))
    from pipeline.manifest import StepError, require_patched_speculators

    tree = make_pristine_site(work / "site", installed).resolve()
    no_record = work / "no-record.json"
    monkeypatch.delenv("EAGLE3_ALLOW_PARTIAL_PATCHES", raising=False)
    with pytest.raises(StepError) as e:
        require_patched_speculators(tree, no_record)
    msg = str(e.value)
    assert "0006-full-precision-resume-state.patch" in msg and f"apply --dist speculators --site {tree}`" in msg
    record = work / "patches.json"
    record.write_text(json.dumps({"dist": DIST, "version": VERSION, "excluded": [p.name for p in PATCHES]}))
    assert require_patched_speculators(tree, record)["not_applied"] == []
    record.write_text(json.dumps({"dist": DIST, "version": "0.0.1", "excluded": [p.name for p in PATCHES]}))
    with pytest.raises(StepError):  # another version's record excuses nothing
        require_patched_speculators(tree, record)
    monkeypatch.setenv("EAGLE3_ALLOW_PARTIAL_PATCHES", "1")
    assert require_patched_speculators(tree, no_record)["not_applied"] == [p.name for p in PATCHES]
    monkeypatch.delenv("EAGLE3_ALLOW_PARTIAL_PATCHES")
    assert ap.apply_series(DIST, tree, compile_pyc=False).ok
    state = require_patched_speculators(tree, no_record)
    assert state["not_applied"] == [] and state["series_sha256"] == ap.series_sha256(DIST, VERSION)
    monkeypatch.setenv("PATH", str(work / "empty-path"))  # no git to check with
    with pytest.raises(StepError, match=f"cannot check that speculators {VERSION} at {tree} .*git"):
        require_patched_speculators(tree, no_record)


def test_train_refusal_comes_before_the_train_folder_is_emptied(work, monkeypatch):
    """`train --force` in an environment the check refuses keeps the checkpoints already there."""
    monkeypatch.syspath_prepend(str(REPO))
    import pipeline.train
    from pipeline.config import load_config
    from pipeline.manifest import StepError
    from pipeline.steps import run

    def refuse():
        raise StepError("speculators is not fully patched (test)")

    monkeypatch.setattr(pipeline.train, "require_patched_speculators", refuse)
    cfg = load_config(REPO / "configs" / "smollm2-cpu-tiny.toml", {"run.runs_dir": str(work / "runs")})
    kept = cfg.step_dir("train") / "checkpoints" / "0" / "model.safetensors"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"weights")
    with pytest.raises(StepError, match="not fully patched"):
        run(cfg, "train", force=True)
    assert kept.read_bytes() == b"weights"
