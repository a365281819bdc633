#!/usr/bin/env bash
# make full: the exit status of a `docker compose up` of the step chain, taken from the step containers
# themselves, so it does not depend on how a Compose version maps --exit-code-from when an earlier step fails.
#   docker/step-exit-code.sh UP_STATUS "<lines: service exit-code state>" STEP...
# Prints one line per step to stderr and the status to stdout: the exit code of the first step (in chain order)
# that exited non-zero; else 1 when a step never ran; else UP_STATUS.
set -euo pipefail
up_status=$1
states=$2
shift 2
fail="" fail_step="" missing=""
for step in "$@"; do
  line=$(awk -v s="$step" '$1 == s {print; exit}' <<<"$states")
  if [ -z "$line" ]; then
    echo "  $step: not run" >&2
    missing="$missing $step"
    continue
  fi
  read -r _ code state _ <<<"$line"
  if [ "$state" = created ]; then  # created but never started (compose stopped the chain before it)
    echo "  $step: not run (created)" >&2
    missing="$missing $step"
    continue
  fi
  echo "  $step: $state, exit $code" >&2
  if [ "$code" != 0 ] && [ -z "$fail" ]; then fail=$code fail_step=$step; fi
done
if [ -n "$fail" ]; then
  echo "make full: step $fail_step failed with exit $fail" >&2
  echo "$fail"
elif [ -n "$missing" ]; then
  echo "make full: step(s)$missing did not run (compose exit $up_status)" >&2
  echo $((up_status != 0 ? up_status : 1))
else
  echo "$up_status"
fi
