# Served acceptance on each prompt source's own held-out prompts, one source at a time, for drafters compared
# before one ships (the rule in NOTES "Drafter quality": MT-bench higher, the full-weight held-out mean no lower).
#
#   DRAFTS="name=DRAFTER_DIR ..." bash tests/bench/heldout_sets.sh PREFIX TAG [TAG ...]
#
# TAG is `sharegpt` (data/packages/sharegpt-user-turns.jsonl.gz) or N (data/prompts/self-prompts-N.jsonl.gz).
# For each, `pipeline.evaluate` on configs/smollm2-quality.toml with that file as the only source at weight 1.0 and
# `eval.prompts=heldout`: the prompts prepare's split keeps out of training for that source alone (80 a set,
# ShareGPT's 74), served by vLLM on the CPU with the target's greedy outputs as baseline (~1 min a drafter and
# ~1.5 min of baseline a set on 2 cores). Results in runs/PREFIX-TAG/ (eval.json, eval.md) and runs/PREFIX-TAG.log;
# each set's drafter rows are printed as it ends.
set -uo pipefail
cd "$(dirname "$0")/../.."
export HF_HOME=$PWD/.cache/hf TMPDIR=$PWD/.cache/tmp VLLM_CACHE_ROOT=$PWD/.cache/vllm
mkdir -p "$TMPDIR" runs
PREFIX=${1:?usage: DRAFTS="name=dir ..." heldout_sets.sh PREFIX TAG [TAG ...]}
shift
[ $# -gt 0 ] && [ -n "${DRAFTS:-}" ] || { echo "usage: DRAFTS=\"name=dir ...\" heldout_sets.sh PREFIX TAG [TAG ...]" >&2; exit 2; }
rc=0
for tag in "$@"; do
  if [ "$tag" = sharegpt ]; then f=data/packages/sharegpt-user-turns.jsonl.gz; else f=data/prompts/self-prompts-$tag.jsonl.gz; fi
  [ -f "$f" ] || { echo "$tag: $f is missing (make model stages the packages; the self-written sets are committed)" >&2; rc=1; continue; }
  # shellcheck disable=SC2086  # DRAFTS is a list of name=dir words
  .venv/bin/python -m pipeline.evaluate --config configs/smollm2-quality.toml --out "runs/$PREFIX-$tag" \
    --set eval.prompts=heldout --set "data.sources=[\"$f\"]" --set 'data.weights=[1.0]' $DRAFTS > "runs/$PREFIX-$tag.log" 2>&1
  r=$?
  echo "$tag rc=$r"
  [ $r = 0 ] || { rc=$r; tail -5 "runs/$PREFIX-$tag.log"; continue; }
  grep '^| [a-z]' "runs/$PREFIX-$tag/eval.md" | grep -v '^| drafter'
done
exit $rc
