#!/usr/bin/env bash
# The upgrade procedure (NOTES "Upgrade procedure") run for real on the cpu flavor, in a copy of the checkout:
# change a version in docker/stacks/vllm-0.32.env, check the patch series against it, rebuild the image (which
# steps hit the layer cache is printed), run the tiny chain in containers with the new image, and compare with a
# run of the unchanged image. Needs `make setup`, `make engine`, `make image FLAVOR=cpu`, and a baseline run
# (default: the container run of tests/bench/container_overhead.sh).
#   bash tests/bench/stack_change.sh [KEY=VALUE] [BASELINE_RUN]     (default TRANSFORMERS_VERSION=5.18.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CHANGE=${1:-TRANSFORMERS_VERSION=5.18.0}
BASE_RUN=${2:-.cache/bench/container-overhead/docker/smollm2-cpu-tiny}
OUT=.cache/bench/stack-change
TAG=eagle3-factory:stack-change
rm -rf "$OUT" && mkdir -p "$OUT/repo" "$OUT/runs"
git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} "$OUT/repo/" 2>/dev/null || true
key=${CHANGE%%=*} value=${CHANGE#*=}
sed -i "s/^$key=.*/$key=$value/" "$OUT/repo/docker/stacks/vllm-0.32.env"
echo "stack change: $(cd "$OUT/repo" && diff <(git -C "$ROOT" show HEAD:docker/stacks/vllm-0.32.env) docker/stacks/vllm-0.32.env | grep '^[<>]' | tr '\n' ' ')"

echo "== patch-check (the series against the pristine speculators wheel of the stack)"
(cd "$OUT/repo" && "$ROOT/.venv/bin/python" patches/apply.py check --all) 2>&1 | tail -n 3

echo "== make image"
t0=$(date +%s)
(cd "$OUT/repo" && make --no-print-directory image STACK=vllm-0.32 FLAVOR=cpu IMAGE=$TAG) > "$OUT/build.log" 2>&1
echo "build: $(( $(date +%s) - t0 )) s"
python3 - "$OUT/build.log" <<'PYEOF'
import re, sys
steps = re.split(r"\nStep \d+/\d+ : ", open(sys.argv[1]).read())[1:]
for s in steps:
    first = s.splitlines()[0]
    if first.startswith(("RUN", "COPY")):
        print(("  cache  " if "Using cache" in s else "  REBUILT") + "  " + first[:110])
PYEOF
docker run --rm --entrypoint cat $TAG /etc/eagle3-factory/image.json | python3 -c \
  "import json,sys; d=json.load(sys.stdin); print('image versions:', {k: v for k, v in d['versions'].items() if v})"

echo "== make full in the new image"
t0=$(date +%s)
make --no-print-directory full RUNNER=docker CONFIG=configs/smollm2-cpu-tiny.toml IMAGE=$TAG RUNS_DIR="$OUT/runs" > "$OUT/full.log" 2>&1
echo "full: $(( $(date +%s) - t0 )) s"
.venv/bin/python -m pipeline.compare "$BASE_RUN" "$OUT/runs/smollm2-cpu-tiny" | tee "$OUT/compare.txt" || true
docker rmi -f $TAG > /dev/null
