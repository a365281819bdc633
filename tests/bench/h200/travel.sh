#!/usr/bin/env bash
# What the device calls carry. Every call sends the tracked tree plus what it carries, 64 MiB in all, and 42 MB of
# the 60-MB tree (session 41) are two files only the launch call reads: the seed prepare starts from and the shipped
# drafter training continues from. Staging calls send the tree without them ("light"): git's index forgets them
# and .git/info/exclude ignores them (the files stay here; untracked files that are not ignored would travel), then
# the index takes them back from HEAD and the exclusion goes ("full") before the launch call. Light, a staging
# call has room for a 46-MB model piece instead of 9.3 MB: the model travels in 2 calls, not 10 (stage_inputs.sh
# sizes the pieces for the light tree). Checked on the device
# in session 41: a file taken out of the index does not arrive there, and one carried once is gone in the next call
# (so the launch call must carry the full tree: run.sh s8-launch refuses to start without these files).
#   bash tests/bench/h200/travel.sh light    before the staging calls
#   bash tests/bench/h200/travel.sh full     before the launch call (and before any commit)
#   bash tests/bench/h200/travel.sh          which it is, and the bytes a call would send with nothing carried
#   bash tests/bench/h200/travel.sh list     the launch-only files
#   bash tests/bench/h200/travel.sh pack     copies of them (and the seed's .json record) in .gpu/launch-only/, for
#                                            a staging call to carry once the full tree nears 64 MiB (NOTES "When
#                                            the launch outgrows a call"): run.sh stashes them into
#                                            data/packages/launch-only/, kept there for the launch and later calls,
#                                            and the launch goes light with S8_SEED and train.init_from set to them
set -euo pipefail
cd "$(dirname "$0")/../../.."
LAUNCH_ONLY=(data/seeds/smollm2-135m-instruct-mix-answers.jsonl.xz data/drafters/smollm2-135m-instruct/model.safetensors)
EXCLUDE=.git/info/exclude   # light adds a line /<file> for each, full takes those lines out
tree() { git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1; }
case ${1:-status} in
  list) printf '%s\n' "${LAUNCH_ONLY[@]}"; exit 0 ;;
  pack) PACK=.gpu/launch-only; seed=${LAUNCH_ONLY[0]}; drafter=${LAUNCH_ONLY[1]%/*}
        for f in "$seed" "${seed%.jsonl.xz}.json" "$drafter/config.json" "$drafter/model.safetensors"; do
          git show "HEAD:$f" 2>/dev/null | cmp -s - "$f" \
            || { echo "travel: $f is missing or differs from HEAD: commit it first" >&2; exit 1; }
        done   # (HEAD's bytes, as the full tree would send them; light or full here)
        rm -rf $PACK && mkdir -p $PACK/drafter
        cp "$seed" "${seed%.jsonl.xz}.json" $PACK/ && cp "$drafter/config.json" "$drafter/model.safetensors" $PACK/drafter/
        echo "travel: $(du -cb $PACK/* $PACK/drafter/* | tail -1 | cut -f1) bytes in $PACK: carry it in a staging call, then" \
             "launch light with S8_SEED=data/packages/launch-only/${seed##*/} and" \
             "train.init_from=data/packages/launch-only/drafter in S8_EXTRA" ;;
  light) git ls-files --error-unmatch "${LAUNCH_ONLY[@]}" > /dev/null 2>&1 || { echo "travel: already light"; exit 0; }
         for f in "${LAUNCH_ONLY[@]}"; do
           [ -f "$f" ] || { echo "travel: $f is missing here: nothing changed" >&2; exit 1; }
           git diff --quiet HEAD -- "$f" \
             || { echo "travel: $f differs from HEAD: commit it first (full puts back HEAD's version)" >&2; exit 1; }
         done
         git rm -q --cached "${LAUNCH_ONLY[@]}"
         mkdir -p "${EXCLUDE%/*}"; printf '/%s\n' "${LAUNCH_ONLY[@]}" >> $EXCLUDE ;;
  full) git reset -q HEAD -- "${LAUNCH_ONLY[@]}"
        [ ! -f $EXCLUDE ] || { grep -v -x -F "$(printf '/%s\n' "${LAUNCH_ONLY[@]}")" $EXCLUDE > $EXCLUDE.new || true
                                mv $EXCLUDE.new $EXCLUDE; } ;;
  status) ;;
  *) echo "usage: $0 [light|full|list|pack]" >&2; exit 2 ;;
esac
if git ls-files --error-unmatch "${LAUNCH_ONLY[@]}" > /dev/null 2>&1; then mode=full; else
  mode="light (run 'bash tests/bench/h200/travel.sh full' before the launch call and before committing)"; fi
echo "travel: $mode; a call sends $(tree) bytes of tree besides what it carries (limit 67108864)"
