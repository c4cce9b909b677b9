#!/usr/bin/env bash
# Issue 5 in one call on nvidia-h200-x2 (torch only; no wheels needed):
#   GPU0: fast K7/8192 (+ profile), fast K3/8192, fast K7/2048, numerics check
#   GPU1: naive K7/2048, fast K7/4096, fast K7/8192 batch 2, naive K7/8192 (expected OOM)
#   then both GPUs: the fast K7 configs through DDP (torchrun), reusing the inductor cache GPU0 filled
#   -> $OUT/train_step.{json,md} (merged, with DDP scaling), train_step_profile.txt, parts.tgz (per-process JSON + logs)
# Usage: BUDGET_S=320 DDP_BUDGET_S=190 bash benchmarks/train_step_gpu.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-12}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the device README: never NVLink multicast
OUT=${OUT:-/tmp/train-step-out}; W=/tmp/train-step; B=${BUDGET_S:-320}; D=${DDP_BUDGET_S:-190}
mkdir -p "$OUT" $W/gpu0 $W/gpu1 $W/ddp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; date -u +%FT%TZ; } > $W/gpu.txt 2>&1
TS="python3 benchmarks/train_step.py --compile on"
CUDA_VISIBLE_DEVICES=0 $TS --budget-s "$B" --profile --label GPU0 --configs fast:7:8192 fast:3:8192 fast:7:2048 \
  --out-dir $W/gpu0 > $W/gpu0/log.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 $TS --budget-s "$B" --skip-numerics --label GPU1 --configs naive:7:2048 fast:7:4096 fast:7:8192:2 \
  naive:7:8192 --out-dir $W/gpu1 > $W/gpu1/log.txt 2>&1 &
wait
torchrun --standalone --nproc_per_node 2 benchmarks/train_step.py --compile on --ddp --budget-s "$D" --label 2xGPU \
  --configs fast:7:8192 fast:7:2048 --out-dir $W/ddp > $W/ddp/log.txt 2>&1
python3 benchmarks/train_step.py --merge $W/gpu0 $W/gpu1 $W/ddp --out-dir "$OUT"
cp $W/gpu0/train_step_profile.txt "$OUT/" 2>/dev/null
tar czf "$OUT/parts.tgz" -C $W . 2>/dev/null
cat "$OUT/train_step.md"; tail -n 5 $W/*/log.txt
