#!/usr/bin/env bash
# make lock-images: resolve each stack's base image tag (VLLM_IMAGE in docker/stacks/*.env) to the digest of its
# multi-arch index with `docker buildx imagetools inspect`, and rewrite docker/images.lock ("<tag> <digest>").
# Needs network and the docker buildx plugin (no engine-side pull). Review the diff and commit the lock.
#   docker/lock-images.sh [LOCK_FILE] [STACK_FILE...]
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=${1:-docker/images.lock}
shift || true
if [ "$#" -eq 0 ]; then set -- docker/stacks/*.env; fi
docker buildx version >/dev/null 2>&1 || {
  echo "lock-images: needs the docker buildx plugin (and network to the registry); nothing changed" >&2; exit 2; }

declare -A DIGEST=()
for f in "$@"; do
  ref=$(sed -n 's/^VLLM_IMAGE=//p' "$f")
  [ -n "$ref" ] || { echo "lock-images: $f has no VLLM_IMAGE=; skipped" >&2; continue; }
  case "$ref" in *@*) echo "lock-images: $f VLLM_IMAGE must be a tag without a digest (the digest lives in $LOCK)" >&2; exit 2;; esac
  out=$(docker buildx imagetools inspect "$ref") || { echo "lock-images: could not inspect $ref" >&2; exit 1; }
  digest=$(awk '$1 == "Digest:" {print $2; exit}' <<<"$out")
  [[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "lock-images: no digest for $ref in:"$'\n'"$out" >&2; exit 1; }
  old=$(awk -v r="$ref" '$1 == r {print $2}' "$LOCK" 2>/dev/null || true)
  if [ "$old" = "$digest" ]; then echo "lock-images: $ref $digest (unchanged)"
  else echo "lock-images: $ref ${old:-<none>} -> $digest"; fi
  DIGEST[$ref]=$digest
done

tmp="$LOCK.tmp"
# comments and the lines of other bases (the cpu flavor's, written by docker/base.sh --lock) stay as they are
{ while IFS= read -r line; do
    [[ "$line" == "#"* || -z "$line" ]] && { echo "$line"; continue; }
    [ -n "${DIGEST[${line%% *}]+x}" ] || echo "$line"
  done < "$LOCK"
  for ref in "${!DIGEST[@]}"; do echo "$ref ${DIGEST[$ref]}"; done | sort; } > "$tmp"
mv "$tmp" "$LOCK"
echo "lock-images: wrote $LOCK; commit it, then make image STACK=<stack>"
