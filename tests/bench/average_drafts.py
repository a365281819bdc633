"""Average the weights of drafters of the same shape (a "model soup"), for serving with pipeline.evaluate.

    PYTHONPATH=$PWD .venv/bin/python tests/bench/average_drafts.py OUT DRAFT_A DRAFT_B [...]

The same as `python -m pipeline.draft_transfer average OUT DRAFT_A DRAFT_B [...]` (kept for the commands NOTES
quotes). To ship an average, `pipeline.ship ... --average-with FOLDER` makes it and records what it averages.
"""
from __future__ import annotations

import sys

from pipeline.draft_transfer import main

if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    sys.exit(main(["average", *sys.argv[1:]]))
