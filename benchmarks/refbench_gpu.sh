#!/usr/bin/env bash
# refbench on a GPU host without vLLM (the `device` H200): regenerate (hf) -> prepare -> capture (hf)
# -> vocab -> train -> export with configs/refbench-gpu.yaml, then pack the draft and the stage
# manifests into $OUT/refbench-gpu.tgz. Evaluate runs afterwards where vLLM is (benchmarks/refbench.py).
# Expects .whl/ (pydantic, datasets, ... wheels for the GPU image's Python) and .device/refbench/ (a copy
# of ../shared/refbench) in the repo root.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/refbench-out}
mkdir -p "$OUT"
W=runs/refbench-gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
date -u +%FT%TZ >> "$OUT/gpu.txt"
timeout "${BUDGET_S:-480}" python3 -m eagle3.cli run --no-prefect --config configs/refbench-gpu.yaml \
  > "$OUT/pipeline.json" 2> "$OUT/pipeline.log"
echo "pipeline rc=$?" | tee -a "$OUT/pipeline.log"
if [ ! -f "$W/draft/config.json" ]; then  # time ran out in train: export the newest checkpoint
  python3 -m eagle3.cli export --checkpoint "$W/train" --out "$W/draft" --target .device/refbench/target-a-llama \
    >> "$OUT/pipeline.json" 2>> "$OUT/pipeline.log"
fi
tar czf "$OUT/refbench-gpu.tgz" --ignore-failed-read "$W/draft" "$W/train/logs" "$W/train/curves.png" \
  "$W/regenerated/conversations.jsonl" "$W/regenerated/manifest.json" "$W/prepared/manifest.json" \
  "$W/captured/manifest.json" "$W/vocab/coverage.json"
tail -c 2000000 "$OUT/pipeline.log" > "$OUT/pipeline.tail.log" && rm "$OUT/pipeline.log"
ls -la "$OUT" "$W" 2>&1 | tail -20
