#!/usr/bin/env bash
# pipeline.self_prompts with each engine on this machine: the same 256 requests asked (seed 2, the shares of the
# NOTES plan "revised after session 28"), each engine's wall seconds (engine start included) and what it kept.
# Needs `make setup` and the model (`make model` or a demo run). Run it on an otherwise idle machine.
#   bash tests/bench/self_prompts_engines.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-256}
OUT=.cache/bench/self-prompts-engines
mkdir -p "$OUT" .cache/tmp
export HF_HOME=$PWD/.cache/hf TMPDIR=$PWD/.cache/tmp VLLM_CACHE_ROOT=$PWD/.cache/vllm
for engine in hf vllm; do
  .venv/bin/python -m pipeline.self_prompts --config configs/smollm2-quality.toml --engine $engine --n "$N" \
    --batch-size "$N" --seed 2 --shares writing=0.2,science=0.15,humanities=0.15 --out "$OUT/$engine.jsonl.gz" \
    > "$OUT/$engine.log" 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]:5s} {d['seconds']:7.1f} s  kept {d['conversations']} of {d['asked']}  dropped {d['dropped']}\")" \
    "$OUT/$engine.jsonl.gz.sources.json" $engine
done
