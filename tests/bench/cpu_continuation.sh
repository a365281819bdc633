# A small continuation of the shipped drafter on one prompt source, run on the CPU (no GPU needed):
# which source's data moves MT-bench, measured before the device's time is spent on it (NOTES "Session 32").
#
#   bash tests/bench/cpu_continuation.sh NAME SOURCE [SEED_ANSWERS]
#   .venv/bin/python tests/bench/mtbench_by_category.py --out runs/bycat/NAME.json NAME=runs/NAME/train/checkpoint
#
# SOURCE's first 2,048 conversations in prepare's seeded order, answered by the target (greedy, vLLM on the CPU,
# ~11 min; or seeded from SEED_ANSWERS, an answers-only file such as data/seeds/...-mix-answers.jsonl.xz), then
# extract, verify, vocab, and one epoch over the first 1,024 training samples from data/drafters/smollm2-135m-instruct
# at lr 2e-4. total_seq_len is 2048, not the recipe's 8192: a step of 8192 tokens over the 49,152-token vocabulary
# needs more than 24 GB on the CPU (the kernel killed it). ~130 tokens/s on 2 cores: ~36 min for the epoch (NOTES "Session 32").
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HOME=$PWD/.cache/hf TMPDIR=$PWD/.cache/tmp VLLM_CACHE_ROOT=$PWD/.cache/vllm PYTHONPATH=$PWD
mkdir -p "$TMPDIR"
NAME=${1:?usage: cpu_continuation.sh NAME SOURCE [SEED_ANSWERS]}
SRC=${2:?usage: cpu_continuation.sh NAME SOURCE [SEED_ANSWERS]}
SEED=${3:-}
C=configs/smollm2-quality.toml
SETS=(--set run.name="$NAME" --set "data.sources=[\"$SRC\"]" --set data.max_conversations=2048
      --set 'data.regenerate="all_turns"' --set vocab.draft_vocab_size=49152 --set train.mask_loops=true
      --set train.init_from=data/drafters/smollm2-135m-instruct --set train.lr=2e-4 --set train.epochs=1
      --set train.total_seq_len=2048 --set train.max_samples=1024)
[ -n "$SEED" ] && SETS+=(--set "data.seed_answers=\"$SEED\"")   # prepare reuses its answers (session 51)
.venv/bin/python -m pipeline model --config $C "${SETS[@]}"
for step in prepare extract verify vocab train; do
  t=$(date +%s)
  .venv/bin/python -m pipeline $step --config $C "${SETS[@]}"
  echo "[cpu-continuation] $NAME $step $(( $(date +%s) - t )) s"
done
