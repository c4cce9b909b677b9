#!/usr/bin/env bash
# More on-policy training prompts for refbench, made on a GPU host without vLLM (the `device` H200):
# number-perturbed copies of GSM8K-train rows 0..7172 (benchmarks/perturb_prompts.py --from-start, one seed per
# copy; the last 300 rows stay the validation source), each answered greedy (<= 256 new tokens) by the target
# with the regenerate stage's `hf` backend; packed into $OUT/regen_gpu.tgz (conversations + manifests; a copy cut by
# the budget comes back as its partial file, whole batches up to progress.json's `bytes`).
# A documented deviation from the refbench protocol's training set (docs/NOTES.md, issue 3).
#   usage: STREAMS="4,7 5,8" DEVICE=cuda:1 BUDGET_S=450 bash benchmarks/refbench_regen_gpu.sh
# STREAMS: space-separated streams run side by side (generation is launch-bound, one GPU serves several),
# each a comma-separated list of seeds done in turn. What finishes inside BUDGET_S comes back.
set -uo pipefail
SITE=/tmp/site-regen
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-/tmp/regen-out}; W=runs/regen-gpu; mkdir -p "$OUT" $W
T=.device/refbench/target-a-llama
t0=$(date +%s)
stream() {
  for seed in ${1//,/ }; do
    d=$W/aug$seed
    python3 benchmarks/perturb_prompts.py --data .device/refbench/data/gsm8k_train.jsonl --from-start --num 7173 \
      --seed "$seed" --out $d/perturbed.jsonl > $d.perturb.json 2>&1 || return
    python3 -m eagle3.cli regenerate --target $T --data $d/perturbed.jsonl --out $d/regen --backend hf \
      --device "${DEVICE:-cuda}" --dtype bfloat16 --batch-size "${BATCH:-1024}" --max-new-tokens 256 \
      --max-model-len 1024 > $d.regen.json 2> $d.regen.log
    echo "seed $seed rc=$? $(( $(date +%s) - t0 ))s" | tee -a $W/times.txt
  done
}
for s in ${STREAMS:-"4,6 5,7"}; do stream "$s" & done
( sleep "${BUDGET_S:-450}"; pkill -f "eagle3.cli regenerate" ) & K=$!
wait $(jobs -p | grep -v "^$K$"); kill $K 2>/dev/null
tar czf "$OUT/regen_gpu.tgz" $W/times.txt $W/*.regen.json $W/*/regen/conversations.jsonl $W/*/regen/manifest.json \
  $W/*/regen/conversations.partial.jsonl $W/*/regen/progress.json 2>/dev/null  # partial: whole batches, see progress.json
ls -la "$OUT/regen_gpu.tgz"; cat $W/times.txt
