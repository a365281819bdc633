#!/usr/bin/env bash
# make doctor: what this host offers the containerised pipeline (Docker, NVIDIA container runtime, GPUs with
# compute capability and driver, disk under data/), and whether the chosen stack's binaries cover these GPUs.
# Read-only. Always exits 0: it reports; `make <step>` / `make image` are what refuse.
#   docker/doctor.sh STACK [MACHINE] [IMAGE] [LOCK_FILE]
set -uo pipefail
cd "$(dirname "$0")/.."
STACK=${1:-vllm-0.32}
MACHINE=${2:-}
IMAGE=${3:-eagle3-factory:$STACK}
LOCK=${4:-docker/images.lock}
STACK_FILE=docker/stacks/$STACK.env
PROBLEMS=0

say() { printf '  %-18s %s\n' "$1" "$2"; }
problem() { printf '  %-18s PROBLEM: %s\n' "$1" "$2"; PROBLEMS=$((PROBLEMS + 1)); }
get() { sed -n "s/^$1=//p" "$STACK_FILE" 2>/dev/null | sed 's/^"//; s/"$//'; }
# version_ge A B: A >= B (dotted numbers)
version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$2" ]; }

echo "stack $STACK"
if [ -f "$STACK_FILE" ]; then
  ARCHS=$(get GPU_ARCHS | tr ',' ' ')
  DRIVER_MIN=$(get CUDA_DRIVER_MIN)
  say versions "vLLM $(get VLLM_VERSION), speculators $(get SPECULATORS_VERSION), torch $(get GPU_TORCH_VERSION) (image) / $(get TORCH_VERSION) (CPU venv)"
  say "base image" "$(get VLLM_IMAGE) (CUDA $(get CUDA_VERSION); needs driver >= ${DRIVER_MIN:-?})"
  say "GPU archs" "${ARCHS:-none recorded}"
  digest=$(awk -v r="$(get VLLM_IMAGE)" '$1 == r {print $2}' "$LOCK" 2>/dev/null)
  case "$digest" in
    sha256:*) say lock "$digest" ;;
    *) problem lock "${digest:-no entry} in $LOCK: run make lock-images on a networked host (or ALLOW_UNPINNED=1)" ;;
  esac
  series=patches/speculators/$(get SPECULATORS_VERSION)/series
  if [ -f "$series" ]; then say "patch series" "$series"; else problem "patch series" "$series missing: make image fails"; fi
else
  problem stack "no $STACK_FILE (stacks: $(cd docker/stacks && ls ./*.env | sed 's|^\./||; s|\.env$||' | tr '\n' ' '))"
  ARCHS="" DRIVER_MIN=""
fi
MACHINE_ARCH=""
CPU_MACHINE=""
if [ -n "$MACHINE" ]; then
  if [ -f "docker/machines/$MACHINE.yaml" ]; then
    MACHINE_ARCH=$(sed -n 's/^x-gpu-arch:[[:space:]]*\([a-z0-9_]*\).*/\1/p' "docker/machines/$MACHINE.yaml")
    if grep -q '^x-flavor:[[:space:]]*cpu' "docker/machines/$MACHINE.yaml"; then
      CPU_MACHINE=1
      say machine "$MACHINE: no GPUs, the cpu flavor (make image STACK=$STACK FLAVOR=cpu)"
      base=$(awk '$1 == "eagle3-factory-base:bookworm" {print $2}' "$LOCK" 2>/dev/null)
      case "$base" in
        sha256:*) say "cpu base" "eagle3-factory-base:bookworm $base (the gpu lock above matters only to gpu images)" ;;
        *) problem "cpu base" "not pinned in $LOCK: make lock-images FLAVOR=cpu" ;;
      esac
    elif [[ " $ARCHS " == *" $MACHINE_ARCH "* ]]; then say machine "$MACHINE ($MACHINE_ARCH): covered by $STACK"
    else problem machine "$MACHINE is $MACHINE_ARCH, which $STACK does not cover (GPU_ARCHS: $ARCHS)"; fi
  else
    problem machine "no docker/machines/$MACHINE.yaml"
  fi
fi

echo "docker"
if command -v docker >/dev/null 2>&1; then
  say cli "$(docker --version 2>/dev/null)"
  server=$(timeout 10 docker version --format '{{.Server.Version}}' 2>/dev/null)
  if [ -n "$server" ]; then
    say engine "$server"
    runtimes=$(timeout 10 docker info --format '{{json .Runtimes}}' 2>/dev/null)
    if [[ "$runtimes" == *nvidia* ]]; then say "nvidia runtime" "registered with the engine"
    elif [ -n "$CPU_MACHINE" ]; then say "nvidia runtime" "not registered (not needed by the cpu flavor)"
    else problem "nvidia runtime" "not registered: install nvidia-container-toolkit, sudo nvidia-ctk runtime configure --runtime=docker, sudo systemctl restart docker"; fi
    if timeout 10 docker image inspect "$IMAGE" >/dev/null 2>&1; then
      say image "$IMAGE $(docker image inspect --format '{{index .Config.Labels "io.eagle3-factory.patch-series-sha256"}}' "$IMAGE" 2>/dev/null | cut -c1-12)"
    else
      say image "$IMAGE not built yet (make image STACK=$STACK)"
    fi
  else
    problem engine "no Docker engine answers here: make engine installs/starts one (Debian/Ubuntu, root); until then make <step> runs with RUNNER=local"
  fi
  compose=$(docker compose version --short 2>/dev/null | sed 's/^v//')
  if [ -z "$compose" ]; then problem compose "docker compose v2 plugin not found"
  elif version_ge "$compose" 2.27.0; then say compose "$compose"
  else problem compose "$compose < 2.27.0: make full needs up --abort-on-container-failure"; fi
  buildx=$(docker buildx version 2>/dev/null | awk '{print $2}')
  if [ -n "$buildx" ]; then say buildx "$buildx"; else say buildx "not installed: make image uses the classic builder; make lock-images FLAVOR=gpu needs buildx"; fi
else
  problem cli "docker CLI not found"
fi
if command -v nvidia-ctk >/dev/null 2>&1; then say nvidia-ctk "$(nvidia-ctk --version 2>/dev/null | head -n 1)"
else say nvidia-ctk "not installed (nvidia-container-toolkit; needed for GPUs in containers)"; fi

echo "GPUs"
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(timeout 30 nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total --format=csv,noheader 2>/dev/null)
fi
if [ -z "$gpus" ]; then
  say none "no NVIDIA GPU or driver on this host (nvidia-smi $(command -v nvidia-smi >/dev/null && echo failed || echo 'not found')): GPU steps cannot run here; the CPU paths are MACHINE=cpu (containers) and RUNNER=local (venv)"
else
  while IFS=, read -r idx name cap driver mem; do
    cap=${cap// /}; driver=${driver// /}
    sm="sm_${cap/./}"
    verdict="covered by $STACK"
    if [[ " $ARCHS " != *" $sm "* ]]; then verdict="NOT covered by $STACK (GPU_ARCHS: $ARCHS)"; PROBLEMS=$((PROBLEMS + 1)); fi
    say "gpu $idx" "$(echo "$name" | sed 's/^ *//'), compute capability $cap ($sm), driver $driver,$mem: $verdict"
    if [ -n "$MACHINE_ARCH" ] && [ "$sm" != "$MACHINE_ARCH" ]; then
      problem "gpu $idx" "MACHINE=$MACHINE expects $MACHINE_ARCH"
    fi
  done <<<"$gpus"
  driver=$(head -n 1 <<<"$gpus" | cut -d, -f4 | tr -d ' ')
  if [ -n "$DRIVER_MIN" ]; then
    if version_ge "$driver" "$DRIVER_MIN"; then say driver "$driver >= $DRIVER_MIN (CUDA $(get CUDA_VERSION))"
    else problem driver "$driver < $DRIVER_MIN required by the CUDA $(get CUDA_VERSION) image: install an R580+ driver"; fi
  fi
fi

echo "disk"
mkdir_hint=""
[ -d data ] || mkdir_hint=" (data/ does not exist yet)"
say "data/" "$(df -h -P "$( [ -d data ] && echo data || echo .)" | awk 'NR == 2 {print $4 " free of " $2 " on " $6}')$mkdir_hint"
say "hidden states" "2 bytes x hidden x (aux layers + 1) per token: 56 KiB/token for Kimi-K2.5 (7168 x 4 layers)"

echo "doctor: $PROBLEMS problem(s)"
exit 0
