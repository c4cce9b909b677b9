#!/usr/bin/env bash
# realbench, the GPU half: SmolLM2-135M-Instruct on a GPU host without vLLM (the `device` H200), in device calls
# to ONE warm machine (it stays warm ~30 s after a call; /tmp survives between calls, the repo copy is re-sent).
#
#   bash benchmarks/realbench/gpu.sh stage      # call 1: carry [.whl, .device/gguf_a, .device/rbdata]
#   bash benchmarks/realbench/gpu.sh data       # call 2: carry [.device/gguf_b]; join + fetch-target, synthesize,
#                                               #   regenerate, prepare, capture, vocab   (~5 min on one H200)
#   bash benchmarks/realbench/gpu.sh train      # call 3: no carry; train + export every draft, pack, first files
#   bash benchmarks/realbench/gpu.sh collect N  # call 4+: the N-th batch of packed files (4 per call)
#
# The carry is built here by `bash benchmarks/realbench/carry.sh`. The GGUF (98 MB) is larger than one call
# carries (64 MiB), so `stage` parks the first half under /tmp and `data` joins it with the second; if the
# machine went back in between, `data` stops at once and says so. Everything else a later call needs stays
# under $S. Each call writes what it measured to $OUT (logs, manifests, timings); `report.py` does the rest here.
set -uo pipefail
S=${REALBENCH_DIR:-/tmp/eagle3-realbench}
OUT=${OUT:-$S/out}
R=$S/report  # everything a call measured; packed into $OUT/report_<call>.tgz when the call ends (8 files come back)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEVICE=${DEVICE:-cuda}
NUM_GSM8K=${NUM_GSM8K:-2000}           # GSM8K-train questions answered by the target
NUM_SYNTH=${NUM_SYNTH:-2400}           # synthesized training prompts asked for (before dedup/filters)
NUM_SYNTH_EVAL=${NUM_SYNTH_EVAL:-320}  # synthesized prompts from the held-out seed (eval only)
SYNTH_TRAIN_SEED=0 SYNTH_EVAL_SEED=777
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
EPOCHS=${EPOCHS:-10}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-360}  # wall limit of each training process (all run at once on the GPU)
REGEN_MAX_NEW=${REGEN_MAX_NEW:-256} SYNTH_MAX_NEW=${SYNTH_MAX_NEW:-160}
TRAIN_EXTRA=${TRAIN_EXTRA:-}           # e.g. "--max-steps 2" for a dry run on the CPU
PY=${PYTHON:-python3}                  # a dry run here: PYTHON=.venv/bin/python SKIP_WHEELS=1 DEVICE=cpu + small sizes
mkdir -p "$S" "$OUT" "$R"
die() { echo "realbench: $*" | tee -a "$R/timings.txt" >&2; exit 1; }
stamp() { echo "$(date -u +%FT%TZ) $*" | tee -a "$R/timings.txt" >&2; }
pack_report() { tail -n 4 "$S"/*.log > "$R/logs_tail.txt" 2>&1; tar czf "$OUT/report_${1:-call}.tgz" -C "$S" report; }

setup_python() {
  if [ "${SKIP_WHEELS:-0}" = 1 ]; then export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; return; fi
  [ -d "$S/whl" ] || die "$S/whl is missing: run 'gpu.sh stage' first on this machine (it was given back?)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S/site" "$S"/whl/*.whl \
    >/dev/null || die "wheel install failed"
  export PYTHONPATH=$S/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false
}
BUDGET_S=${BUDGET_S:-550}  # each call stops its stages by then, so its report still comes back (call limit 600 s)
E() { timeout -k 5 $((BUDGET_S - SECONDS > 5 ? BUDGET_S - SECONDS : 5)) $PY -m eagle3.cli "$@"; }

gpu_info() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u +%FT%TZ;
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } \
    > "$R/gpu.txt" 2>&1
}

cmd_stage() {
  [ -f .device/gguf_a/gguf.part.00 ] || die "carry .device/gguf_a (built by benchmarks/realbench/carry.sh)"
  cp .device/gguf_a/gguf.part.00 "$S/" && cp -r .whl "$S/whl" && cp -r .device/rbdata "$S/rbdata" || die "copy failed"
  ls -la "$S" | tee "$R/stage.txt"
}

cmd_data() {
  setup_python; gpu_info; stamp data-start
  local T=$S/target
  if [ ! -f "$T/manifest.json" ]; then join_gguf; fi  # a rerun of `data` on the same machine reuses every finished stage
  E fetch-target smollm2-135m-instruct --gguf "$S/smollm2.gguf" --out "$T" > "$R/fetch.json" || die "fetch-target failed"
  stamp fetched
  make_data
}

join_gguf() {
  [ -f "$S/gguf.part.00" ] || die "the first half of the GGUF is gone from $S: the machine was given back after \
'gpu.sh stage'. Run 'stage' again and send 'data' within the machine's warm window (~30 s)."
  [ -f .device/gguf_b/gguf.part.01 ] || die "carry .device/gguf_b (the second half)"
  cat "$S/gguf.part.00" .device/gguf_b/gguf.part.01 > "$S/smollm2.gguf"
  echo "$GGUF_SHA256  $S/smollm2.gguf" | sha256sum -c --quiet || die "joined GGUF has the wrong sha256"
}

make_data() {
  local T=$S/target
  $PY benchmarks/realbench/sources.py train --refbench-data "$S/rbdata" --num-gsm8k "$NUM_GSM8K" --out "$S/src" \
    > "$R/sources_train.json" || die "sources failed"
  # prompts the target writes itself: the training seed and, separately, the held-out seed
  E synthesize --target "$T" --out "$S/synth_train" --backend hf --device "$DEVICE" --num-prompts "$NUM_SYNTH" --max-new-tokens "$SYNTH_MAX_NEW" --batch-size 512 \
    --seed $SYNTH_TRAIN_SEED > "$R/synth_train.json" 2> "$S/synth_train.log" || die "synthesize (train) failed"
  E synthesize --target "$T" --out "$S/synth_eval" --backend hf --device "$DEVICE" --num-prompts "$NUM_SYNTH_EVAL" --max-new-tokens "$SYNTH_MAX_NEW" --batch-size 512 \
    --seed $SYNTH_EVAL_SEED > "$R/synth_eval.json" 2> "$S/synth_eval.log" || die "synthesize (eval) failed"
  stamp synthesized
  $PY benchmarks/realbench/sources.py eval --refbench-data "$S/rbdata" --synth-eval "$S/synth_eval/prompts.jsonl" \
    --synth-train "$S/synth_train/prompts.jsonl" --out "$R/eval_prompts.jsonl" > "$R/sources_eval.json" \
    || die "eval prompts failed"
  # the target answers every training prompt (greedy, <= 256 new tokens): three streams side by side on the GPU
  declare -A data=([gsm8k]=$S/src/gsm8k.jsonl [synth]=$S/synth_train/prompts.jsonl [chat]=$S/src/chat_train.jsonl)
  for name in gsm8k synth chat; do
    E regenerate --target "$T" --data "${data[$name]}" --out "$S/regen_$name" --backend hf --device "$DEVICE" \
      --max-new-tokens "$REGEN_MAX_NEW" --temperature 0 --batch-size 512 --max-model-len 2048 \
      > "$R/regen_$name.json" 2> "$S/regen_$name.log" &
  done
  wait
  for name in gsm8k synth chat; do [ -s "$S/regen_$name/conversations.jsonl" ] || die "regenerate $name failed"; done
  stamp regenerated
  cat "$S"/regen_{gsm8k,synth,chat}/conversations.jsonl > "$S/mix.jsonl"
  for name in gsm8k synth chat mix; do
    local src=$S/regen_$name/conversations.jsonl; [ $name = mix ] && src=$S/mix.jsonl
    E prepare --target "$T" --data "$src" --out "$S/prep_$name" --max-seq-len 2048 > "$R/prep_$name.json" \
      2> "$S/prep_$name.log" &
  done
  wait
  stamp prepared
  for name in gsm8k synth chat; do
    E capture --target "$T" --data "$S/prep_$name" --out "$S/cap_$name" --backend hf --device "$DEVICE" \
      --batch-tokens 65536 > "$R/cap_$name.json" 2> "$S/cap_$name.log" || die "capture $name failed"
  done
  stamp captured
  for name in gsm8k synth mix; do
    E vocab --data "$S/prep_$name" --out "$S/vocab_$name" --draft-vocab-size "$DRAFT_VOCAB" > "$R/vocab_$name.json" \
      || die "vocab $name failed"
  done
  stamp data-done
  tar czf "$R/data_manifests.tgz" -C "$S" --ignore-failed-read synth_train/manifest.json synth_eval/manifest.json \
    synth_train/prompts.jsonl regen_gsm8k/manifest.json regen_synth/manifest.json regen_chat/manifest.json \
    prep_gsm8k/manifest.json prep_synth/manifest.json prep_chat/manifest.json prep_mix/manifest.json \
    cap_gsm8k/manifest.json cap_synth/manifest.json cap_chat/manifest.json vocab_gsm8k/coverage.json \
    vocab_synth/coverage.json vocab_mix/coverage.json target/manifest.json
  cat "$R/timings.txt"
}

# One draft per (method, training data). EAGLE-3.1 adds fc_norm + norm_output to the same recipe.
RECIPE=(--device "$DEVICE" --ttt-steps 3 --num-speculative-tokens 3 --epochs "$EPOCHS" --lr 2e-3 --warmup-steps 100
  --weight-decay 0.1 --hidden-noise 0.1 --supervise all --init-head-from-target --feature-loss-weight 20
  --max-seq-len 2048 --batch-size 8 --eval-every 50 --save-every 200 --val-fraction 0.02 --seed 0)
EAGLE31=(--draft-fc-norm --draft-norm-output)

train_one() {  # name method data
  local name=$1 method=$2 data=$3 extra=()
  local captured="$S/cap_$data" vocab="$S/vocab_$data"
  [ "$data" = mix ] && captured="$S/cap_gsm8k,$S/cap_synth,$S/cap_chat"
  [ "$method" = eagle3.1 ] && extra=("${EAGLE31[@]}")
  timeout -k 5 "$TRAIN_BUDGET_S" $PY -m eagle3.cli train --target "$S/target" --captured "$captured" --vocab "$vocab" \
    --out "$S/train_$name" "${RECIPE[@]}" "${extra[@]}" $TRAIN_EXTRA > "$S/train_$name.json" 2> "$S/train_$name.log"
  echo "train $name rc=$?" >> "$R/timings.txt"
  E export --checkpoint "$S/train_$name" --out "$S/drafts/$name" --target "$S/target" > "$S/export_$name.json" \
    2>> "$S/train_$name.log" || echo "export $name failed" >> "$R/timings.txt"
}

cmd_train() {
  [ -d "$S/cap_gsm8k" ] || die "no captures under $S: run 'data' first on this machine (it was given back?)"
  setup_python; stamp train-start
  local runs=(eagle3-gsm8k:eagle3:gsm8k eagle3-synth:eagle3:synth eagle3-mix:eagle3:mix
              eagle3.1-gsm8k:eagle3.1:gsm8k eagle3.1-synth:eagle3.1:synth eagle3.1-mix:eagle3.1:mix)
  for r in "${runs[@]}"; do IFS=: read -r name method data <<< "$r"; train_one "$name" "$method" "$data" & done
  wait
  stamp train-done
  # pack: each draft's directory + its training log/metrics, split in <= 15 MiB pieces, 8 files per collect call
  rm -rf "$S/pack" && mkdir -p "$S/pack"
  for r in "${runs[@]}"; do
    name=${r%%:*}
    tar cJf "$S/pack/$name.tar.xz" -C "$S" "drafts/$name" "train_$name/logs" "train_$name.json" 2>/dev/null \
      || echo "pack $name failed" >> "$R/timings.txt"
  done
  (cd "$S/pack" && for f in *.tar.xz; do split -b 15M -d "$f" "$f.part"; rm "$f"; done; ls -la) > "$R/pack.txt"
  cmd_collect 0
}

PER_CALL=4  # packed files per call: a call brings back at most 64 MiB in all, and one draft packs to ~14.5 MB
cmd_collect() {  # the N-th group of PER_CALL packed files (the call's report tarball rides along)
  local n=${1:-0} i=0
  for f in $(ls "$S/pack" | sort); do
    if [ $((i / PER_CALL)) -eq "$n" ]; then cp "$S/pack/$f" "$OUT/"; fi
    i=$((i + 1))
  done
  echo "collect $n: $(ls "$OUT" | tr '\n' ' ') (of $i packed files)"
}

trap 'pack_report "${1:-}"' EXIT
case "${1:-}" in
  stage) cmd_stage ;;
  data) cmd_data ;;
  train) cmd_train ;;
  collect) cmd_collect "${2:-0}" ;;
  *) die "usage: gpu.sh stage|data|train|collect N" ;;
esac
