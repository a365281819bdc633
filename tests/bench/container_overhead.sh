#!/usr/bin/env bash
# The container run's wall time against the venv run of the same config, back to back on this machine, and
# `make compare` between the two. Needs `make setup`, `make engine` and `make image FLAVOR=cpu`.
#   bash tests/bench/container_overhead.sh [CONFIG]        (default configs/smollm2-cpu-tiny.toml)
# Writes .cache/bench/container-overhead/{docker,venv}/ (the two runs) and summary.json; prints the ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."
CONFIG=${1:-configs/smollm2-cpu-tiny.toml}
OUT=.cache/bench/container-overhead
rm -rf "$OUT" && mkdir -p "$OUT/docker" "$OUT/venv"
name=$(sed -n 's/^name = "\(.*\)"/\1/p' "$CONFIG" | head -n 1)

t0=$(date +%s.%N)
make --no-print-directory full RUNNER=docker CONFIG="$CONFIG" RUNS_DIR="$OUT/docker" > "$OUT/docker.log" 2>&1
t1=$(date +%s.%N)
make --no-print-directory full RUNNER=local CONFIG="$CONFIG" ARGS="--set run.runs_dir=\"$OUT/venv\"" > "$OUT/venv.log" 2>&1
t2=$(date +%s.%N)
rc=0
.venv/bin/python -m pipeline.compare "$OUT/docker/$name" "$OUT/venv/$name" --json "$OUT/compare.json" > "$OUT/compare.txt" || rc=$?
python3 - "$t0" "$t1" "$t2" "$rc" "$OUT" <<'PYEOF'
import json, sys
t0, t1, t2, rc, out = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
d, v = t1 - t0, t2 - t1
summary = {"docker_wall_s": round(d, 1), "venv_wall_s": round(v, 1), "ratio": round(d / v, 3), "compare_exit": rc}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(open(f"{out}/compare.txt").read())
print(json.dumps(summary))
PYEOF
