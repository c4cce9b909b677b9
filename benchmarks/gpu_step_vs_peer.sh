#!/usr/bin/env bash
# Training speed against the peer in ONE device call on one GPU: our train step and the peer's
# (speculators 0.9.0), same card, same clock.
#
#   phase 1  ours, Llama-3.1-8B draft dims (benchmarks/train_step.py --dims llama-3.1-8b), fresh
#            inductor + Triton caches (the "fresh machine" first step incl. compilation); writes the
#            compile cache file after each config
#   phase 2  the peer ($PEERBENCH/bench_eagle3.py: ../shared/peerbench, carried in the pack
#            `peer`) at the same configs, own caches
#   phase 3  compile cache round trip: a second process, EMPTY inductor/Triton caches, seeded only
#            by torch.compiler.load_cache_artifacts(phase 1's file) -> its first step (same machine,
#            not a fresh one); then, budget permitting, torch.profiler kernel groups of that step
#            (in ours_cache.json; the kernel table in logs.tgz) and the GPU numerics check (fast
#            step incl. its flex attention vs the naive reference, values and grads, small draft)
#            and the attention-only fp32 check
#   phase 4  ours at Kimi-K2.5 draft dims (hidden 7168, 64 heads of 112, intermediate 18432,
#            Vd 32000 of 163,840)
#   phase 5  (--ddp N, N GPUs) ours through DDP on N GPUs (torchrun), rows "K7-T8192-DDPxN"
#   merge    benchmarks/step_vs_peer.py -> $OUT/train_step_vs_peer.{json,md} (the issue's shape;
#            null where not run)
# Each phase runs under `timeout` with its own --budget-s (its watchdog writes partial results)
# taken from what is left of --budget-s; a phase that fails or overruns leaves null fields, the
# merge always runs.
# $OUT gets <= 8 files: train_step_vs_peer.{json,md}, ours_llama.json, ours_kimi.json,
# ours_cache.json, peer_results.json, gpu.txt, logs.tgz.
#
# On the GPU host through benchmarks/offline_gpu (benchmarks/README.md): the pack `peer` holds
# speculators 0.9.0 and its needs the image lacks, and the peer harness (../shared/peerbench);
# torch, transformers and Triton come from the image. PEERBENCH names the harness's folder.
#
# Usage (defaults shown):
#   bash benchmarks/gpu_step_vs_peer.sh --budget-s 500 --ours "fast:7:8192 fast:7:2048" \
#        --peer 2048:7,8192:7 --kimi "fast:7:8192 fast:3:8192" [--compile-mode split] \
#        [--no-peer] [--no-kimi] [--no-cache] [--out DIR] \
#        [--ours-max-s 170 (phase 1's budget at most: a cold compile per config, ~110 s at
#        K7-T8192)] \
#        [--ddp 2 --ddp-configs "fast:7:8192"]
#   bash benchmarks/gpu_step_vs_peer.sh --smoke --out /tmp/x
#        # CPU: tiny dims, no peer (it needs CUDA)
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL=500 OURS="fast:7:8192 fast:7:2048" PEER="2048:7,8192:7" KIMI="fast:7:8192 fast:3:8192" \
  MODE=split
SMOKE=0 DO_PEER=1 DO_KIMI=1 DO_CACHE=1 OUTDIR=${OUT:-/tmp/step-vs-peer-out} DDP=0 \
  DDP_CONFIGS="fast:7:8192"
OURS_MAX_S=170
CMD="bash benchmarks/gpu_step_vs_peer.sh $*"
while [ $# -gt 0 ]; do
  case $1 in
    --budget-s) TOTAL=$2; shift ;;
    --ours) OURS=$2; shift ;;
    --ours-max-s) OURS_MAX_S=$2; shift ;;
    --peer) PEER=$2; shift ;;
    --kimi) KIMI=$2; shift ;;
    --compile-mode) MODE=$2; shift ;;
    --ddp) DDP=$2; shift ;;
    --ddp-configs) DDP_CONFIGS=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    --smoke) SMOKE=1 ;;
    --no-peer) DO_PEER=0 ;;
    --no-kimi) DO_KIMI=0 ;;
    --no-cache) DO_CACHE=0 ;;
    *) echo "gpu_step_vs_peer.sh: unknown argument $1 (see the header for the options)" >&2
       exit 2 ;;
  esac
  shift
done
T0=$SECONDS
left() { echo $((TOTAL - (SECONDS - T0))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
W=$(mktemp -d /tmp/step-vs-peer.XXXX)
mkdir -p "$OUTDIR" "$W/logs"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-16}
PY=${PYTHON:-python3}
TS="$PY benchmarks/train_step.py --compile on --compile-mode $MODE"
TS+=" --skip-numerics --fill-batch 0"
if [ "$SMOKE" = 1 ]; then
  TS="$PY benchmarks/train_step.py --smoke --device cpu --skip-numerics --fill-batch 0"
  TS+=" --compile-mode $MODE"
  DDP_CONFIGS="fast:3:32"
  OURS="fast:7:64 fast:7:32" KIMI="fast:7:64 fast:3:64"
  # the peer harness needs CUDA (torch.cuda events, autocast)
  command -v nvidia-smi > /dev/null || DO_PEER=0
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  date -u +%FT%TZ; nproc; } > "$OUTDIR/gpu.txt"

# run NAME BUDGET_S CMD...: one phase under `timeout` (its own watchdog fires first), log in
# $W/logs/NAME.log
run() {
  local name=$1 b=$2; shift 2
  echo "[$((SECONDS - T0))s] $name: budget ${b}s" | tee -a "$W/logs/phases.txt"
  timeout -k 5 $((b + 20)) "$@" > "$W/logs/$name.log" 2>&1
  echo "[$((SECONDS - T0))s] $name: rc=$?" | tee -a "$W/logs/phases.txt"
}
# reserve what the later phases need at least (s): peer 150 (its first steps: 45 s at 2048, 73 s at
# 8192; it runs 2048 first so that its "next config takes 1.2x the longest so far" guard lets 8192
# in), cache 40, kimi 90, merge 10
DO_DDP=$((DDP > 1 ? 1 : 0))
RES_PEER=$((DO_PEER * 150)) RES_CACHE=$((DO_CACHE * 40)) RES_KIMI=$((DO_KIMI * 90)) \
  RES_DDP=$((DO_DDP * 60))

# phase 1: ours, Llama-8B dims, cold caches
B=$(min "$OURS_MAX_S" $(($(left) - RES_PEER - RES_CACHE - RES_KIMI - RES_DDP - 10)))
# shellcheck disable=SC2086
TORCHINDUCTOR_CACHE_DIR=$W/ind-ours TRITON_CACHE_DIR=$W/triton-ours run ours_llama "$B" \
  $TS --dims llama-3.1-8b --budget-s "$B" --label ours-llama --compile-cache "$W/llama.cache" \
  --configs $OURS --out-dir "$W/ours-llama" --compile-guess-s 45

# phase 2: the peer, same dims, own caches
if [ "$DO_PEER" = 1 ]; then
  PEERBENCH=${PEERBENCH:-${EAGLE3_CARRIED:-/none}/peer/files/peerbench}
  if [ -f "$PEERBENCH/bench_eagle3.py" ] && $PY -c "import speculators" 2> /dev/null; then
    B=$(min 180 $(($(left) - RES_CACHE - RES_KIMI - RES_DDP - 10)))
    TORCHDYNAMO_SUPPRESS_ERRORS=1 \
      TORCHINDUCTOR_CACHE_DIR=$W/ind-peer TRITON_CACHE_DIR=$W/triton-peer \
      run peer "$B" $PY "$PEERBENCH/bench_eagle3.py" --configs "$PEER" --out "$W/peer" \
      --budget-s $((B - 60)) --hard-limit-s $((B - 5))
  else
    echo "peer: no speculators or no harness at $PEERBENCH (the pack \`peer\` not installed)" \
      | tee -a "$W/logs/phases.txt"
  fi
fi

# phase 3: the compile cache round trip (first config of --ours, empty caches, the artifact file
# only)
if [ "$DO_CACHE" = 1 ] && [ -f "$W/llama.cache" ]; then
  # the second process rewrites its file; keep phase 1's intact
  cp "$W/llama.cache" "$W/llama-copy.cache"
  B=$(min 150 $(($(left) - RES_KIMI - RES_DDP - 10)))
  # shellcheck disable=SC2086
  TORCHINDUCTOR_CACHE_DIR=$W/ind-cache TRITON_CACHE_DIR=$W/triton-cache run cache "$B" \
    ${TS/--skip-numerics/} --dims llama-3.1-8b --budget-s "$B" --label cache-loaded \
    --compile-cache "$W/llama-copy.cache" \
    --warmup 2 --iters 5 --configs ${OURS%% *} --out-dir "$W/cache" --profile --compile-guess-s 20
  # kernel table of that config (in logs.tgz)
  cp "$W/cache/train_step_profile.txt" "$W/logs/" 2>/dev/null
elif [ "$DO_CACHE" = 1 ]; then
  echo "cache: phase 1 wrote no compile cache file (no compiled config finished)" \
    | tee -a "$W/logs/phases.txt"
fi

# phase 4: ours at Kimi-K2.5 draft dims
if [ "$DO_KIMI" = 1 ]; then
  B=$(($(left) - RES_DDP - 10))
  # shellcheck disable=SC2086
  [ "$B" -gt 30 ] \
    && TORCHINDUCTOR_CACHE_DIR=$W/ind-ours TRITON_CACHE_DIR=$W/triton-ours run ours_kimi "$B" \
    $TS --dims kimi-k2.5 --budget-s "$B" --label ours-kimi --configs $KIMI --out-dir "$W/ours-kimi"
fi

# phase 5: DDP over N GPUs (reuses phase 1's inductor cache: same shapes per rank)
if [ "$DO_DDP" = 1 ]; then
  B=$(($(left) - 10))
  # the device README: never NVLink multicast
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  # shellcheck disable=SC2086
  [ "$B" -gt 30 ] \
    && TORCHINDUCTOR_CACHE_DIR=$W/ind-ours TRITON_CACHE_DIR=$W/triton-ours run ddp "$B" \
    ${PYTHON:-python3} -m torch.distributed.run --standalone --nproc_per_node "$DDP" \
    ${TS#"$PY"} --ddp --dims llama-3.1-8b --budget-s "$B" --label "ddp-x$DDP" \
    --configs $DDP_CONFIGS --out-dir "$W/ddp"
fi

# merge (always) and the files that come back
PEER_ARG=() CACHE_ARG=() EXTRA_DIRS=()
[ "$DO_PEER" = 1 ] && PEER_ARG=(--peer "$W/peer/results.json")
[ "$DO_CACHE" = 1 ] && CACHE_ARG=(--cache-run "$W/cache")
[ "$DO_KIMI" = 1 ] && EXTRA_DIRS=("$W/ours-kimi")
[ "$DO_DDP" = 1 ] && EXTRA_DIRS+=("$W/ddp")
$PY benchmarks/step_vs_peer.py --ours "$W/ours-llama" "${EXTRA_DIRS[@]}" "${PEER_ARG[@]}" \
  "${CACHE_ARG[@]}" \
  --out-dir "$OUTDIR" --command "$CMD" > "$W/logs/merge.log" 2>&1
cp "$W/ours-llama/train_step.json" "$OUTDIR/ours_llama.json" 2>/dev/null
cp "$W/ours-kimi/train_step.json" "$OUTDIR/ours_kimi.json" 2>/dev/null
cp "$W/cache/train_step.json" "$OUTDIR/ours_cache.json" 2>/dev/null
cp "$W/peer/results.json" "$OUTDIR/peer_results.json" 2>/dev/null
ls -la "$W"/*.cache >> "$W/logs/phases.txt" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$W" logs 2>/dev/null
cat "$W/logs/merge.log" "$W/logs/phases.txt"
echo "total $((SECONDS - T0)) s"
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$W"
