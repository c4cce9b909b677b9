#!/usr/bin/env bash
# The golden capture check on the GPU host's vLLM (the pack `vllm`, benchmarks/README.md):
# touchpoints on the installed vLLM, then benchmarks/vllm_golden.py on Model Runner V2 and V1, in
# float32 and bfloat16, on the tiny targets and TARGET_DIR (a real model: every aux id), each while
# the run has time left (DEADLINE_S, default 1800 s). Results into $RUN_DIR/out/golden:
#
#   bash benchmarks/offline_gpu/host.sh start golden -- \
#     bash benchmarks/vllm_gpu/golden.sh [TARGET_DIR]
set -uo pipefail
G=${RUN_DIR:-/tmp/eagle3-golden}/out/golden
mkdir -p "$G"
python3 benchmarks/vllm_touchpoints.py --installed -v > "$G/touchpoints.log" 2>&1
tail -n 2 "$G/touchpoints.log"
for run in "1 float32" "0 float32" "1 bfloat16" "0 bfloat16"; do
  read -r runner dtype <<< "$run"
  if [ "$SECONDS" -gt "${DEADLINE_S:-1800}" ]; then echo "skipped (deadline): $run"; continue; fi
  name=golden_v$([ "$runner" = 1 ] && echo 2 || echo 1)_$dtype
  VLLM_USE_V2_MODEL_RUNNER=$runner python3 benchmarks/vllm_golden.py "$G/$name.json" \
    --dtype "$dtype" --targets "${TARGETS:-llama,qwen3_moe,deepseek_v3}" \
    ${1:+--target-dir "$1"} > "$G/$name.log" 2>&1
  tail -n 3 "$G/$name.log"
done
