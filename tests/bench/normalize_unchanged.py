"""Check (a script, not a test): the packaged ShareGPT loads the same under this checkout's
pipeline/datasets.py as under an earlier commit's (conversations and drop counts).

    .venv/bin/python tests/bench/normalize_unchanged.py [REV]      # default REV: 8a42dbd (before agentic records)
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    import pipeline.datasets as new

    rev = sys.argv[1] if len(sys.argv) > 1 else "8a42dbd"
    old_path = REPO / ".cache" / "bench" / f"datasets-{rev}.py"
    old_path.parent.mkdir(parents=True, exist_ok=True)
    old_path.write_text(subprocess.run(["git", "show", f"{rev}:pipeline/datasets.py"], cwd=REPO, check=True,
                                       capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("pipeline._datasets_old", old_path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    a, ra = old.load_conversations("vllm-0.32")
    b, rb = new.load_conversations("vllm-0.32")
    print(f"{rev}: {len(a)} conversations, dropped {ra.dropped}")
    print(f"now: {len(b)} conversations, dropped {rb.dropped}")
    print("identical" if a == b and ra.dropped == rb.dropped else "DIFFERENT")
    old_path.unlink()


if __name__ == "__main__":
    main()
