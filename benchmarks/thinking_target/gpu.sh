#!/usr/bin/env bash
# The thinking target, the GPU half: build it on a GPU host without internet (the `device` H200)
# in two calls to ONE warm machine (it stays warm ~30 s after a call; /tmp survives between calls,
# the repo copy is sent again). The carry is built here by benchmarks/thinking_target/carry.sh.
#
#   bash benchmarks/thinking_target/gpu.sh stage   # each call: parks what it carried (.whl,
#                                                  #   .device/tt_a, .device/tt_b) under $S
#   bash benchmarks/thinking_target/gpu.sh build   # joins + checks the GGUF, installs the wheels,
#                                                  #   runs `recipe.py build`, puts the adapter's
#                                                  #   parts and the reports into $OUT
#
# Sizes come from the environment (defaults: the full recipe): EPOCHS, LR, RANK, MAX_LEN,
# BATCH_TOKENS, TRAIN_BUDGET_S (wall limit of training: it stops and saves), MAX_STEPS,
# MAX_EXAMPLES, CHECK_PROMPTS, CHECK_MAX_NEW, CHECK_BATCH, DEVICE. A dry run on this CPU:
#   THINKING_DIR=/tmp/ttdry OUT=/tmp/ttdry/out SKIP_WHEELS=1 PYTHON=.venv/bin/python DEVICE=cpu \
#     MAX_STEPS=2 MAX_EXAMPLES=8 MAX_LEN=256 BATCH_TOKENS=512 CHECK_PROMPTS=1 CHECK_MAX_NEW=8 \
#     bash -c 'G=benchmarks/thinking_target/gpu.sh; bash $G stage && bash $G build'
set -uo pipefail
S=${THINKING_DIR:-/tmp/eagle3-thinking}
OUT=${OUT:-$S/out}
PY=${PYTHON:-python3}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$S" "$OUT"
die() { echo "thinking_target/gpu.sh: $*" >&2; exit 1; }

cmd_stage() {  # idempotent
  local n=0 f
  if [ -d .whl ] && [ ! -d "$S/whl" ]; then cp -r .whl "$S/whl" && n=$((n + 1)); fi
  for f in .device/tt_a/* .device/tt_b/*; do
    [ -f "$f" ] && cp "$f" "$S/" && n=$((n + 1))
  done
  [ "$n" -gt 0 ] || die "stage: nothing carried (carry .whl and .device/tt_a, then .device/tt_b)"
  ls -la "$S"
}

cmd_build() {
  local m="" p
  [ -d "$S/whl" ] || [ "${SKIP_WHEELS:-0}" = 1 ] || m="$m .whl"
  for p in data.tgz gguf.part.00 gguf.part.01; do [ -f "$S/$p" ] || m="$m $p"; done
  [ -z "$m" ] || die "not parked under $S:$m. The machine was given back between the calls (the" \
    "second must come within its warm window, ~30 s), or a part was never carried: stage again."
  if [ "${SKIP_WHEELS:-0}" = 1 ]; then
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  else
    [ -d "$S/site" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$S/site" "$S"/whl/*.whl >/dev/null \
      || die "wheel install failed"
    export PYTHONPATH=$S/site:$PWD/src
  fi
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  { nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; date -u +%FT%TZ;
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
      transformers.__version__)'; } | tee "$OUT/machine.txt"
  [ -f "$S/smollm2.gguf" ] || cat "$S/gguf.part.00" "$S/gguf.part.01" > "$S/smollm2.gguf"
  echo "$GGUF_SHA256  $S/smollm2.gguf" | sha256sum -c --quiet \
    || { rm -f "$S/smollm2.gguf"; die "the GGUF parts do not join to the published file"; }
  [ -d "$S/data" ] || tar xzf "$S/data.tgz" -C "$S" || die "data.tgz does not unpack"
  local flags=(--out "$S/build" --data "$S/data" --gguf "$S/smollm2.gguf"
    --device "${DEVICE:-cuda}" --epochs "${EPOCHS:-2}" --lr "${LR:-5e-4}" --rank "${RANK:-32}"
    --max-len "${MAX_LEN:-1024}" --batch-tokens "${BATCH_TOKENS:-16384}"
    --budget-s "${TRAIN_BUDGET_S:-330}" --check-prompts "${CHECK_PROMPTS:-100}"
    --check-max-new-tokens "${CHECK_MAX_NEW:-512}" --check-batch-size "${CHECK_BATCH:-100}")
  [ -n "${MAX_STEPS:-}" ] && flags+=(--max-steps "$MAX_STEPS")
  [ -n "${MAX_EXAMPLES:-}" ] && flags+=(--max-examples "$MAX_EXAMPLES")
  $PY benchmarks/thinking_target/recipe.py build "${flags[@]}" 2>&1 | tee "$OUT/build.log"
  local rc=${PIPESTATUS[0]}
  # what comes back (at most 8 files of 16 MiB): the adapter's parts, its json, the reports
  cp "$S"/build/adapter/adapter.json "$S"/build/adapter/adapter.safetensors.part.* "$OUT/" \
    2>/dev/null
  tar czf "$OUT/reports.tgz" -C "$S/build" build.json check.json adapter/metrics.jsonl \
    target/manifest.json 2>/dev/null
  ls -la "$OUT"
  return "$rc"
}

case "${1:-}" in
  stage) cmd_stage ;;
  build) cmd_build ;;
  *) die "usage: gpu.sh stage|build" ;;
esac
