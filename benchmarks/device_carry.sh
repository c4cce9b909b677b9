#!/usr/bin/env bash
# Rebuild, on this CPU host, the git-ignored files a refbench GPU call carries (`carry: [".whl", ".device"]`):
#   .whl/                   wheels the GPU image lacks (pydantic, datasets and their own needs), at the versions
#                           .venv holds, for the image's Python 3.12
#   .device/refbench/       a copy of ../shared/refbench (target + data; ShareGPT sample left out)
#   .device/regen/train.jsonl  the protocol's training set: every GSM8K-train question answered greedy (<= 256 new
#                           tokens) by the target through this host's vLLM (~15 min on 2 cores)
#   .device/regen/val.jsonl the 300 validation prompts (last 300 GSM8K-train rows, numbers changed:
#                           benchmarks/perturb_prompts.py, seed 0) answered the same way; checkpoint selection only
# A fresh checkout has none of them (they are git-ignored); `SKIP_REGEN=1` only rebuilds .whl and the copy.
#
# `bash benchmarks/device_carry.sh peer` builds instead what benchmarks/gpu_step_vs_peer.sh carries
# (`carry: [".whl", ".peerbench"]`): the peer harness copied from ../shared/peerbench into .peerbench/ and its
# wheels added to .whl/ (speculators==0.9.0, loguru, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# annotated-types, typing-inspection, typing-extensions; Python 3.12 manylinux, --no-deps, the .venv's versions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
download() {  # shellcheck disable=SC2068
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $@
}
if [ "${1:-}" = peer ]; then
  mkdir -p .whl
  pkgs="speculators==0.9.0"
  for p in loguru pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection typing_extensions; do
    pkgs="$pkgs $p==$(ver $p)"
  done
  # shellcheck disable=SC2086
  download $pkgs
  rm -rf .peerbench && cp -r ../shared/peerbench .peerbench && chmod -R u+w .peerbench
  du -sh .whl .peerbench
  exit 0
fi
mkdir -p .whl .device/regen
rm -f .whl/*.whl
pkgs=""
for p in pydantic pydantic_core annotated-types typing-inspection typing_extensions datasets dill multiprocess; do
  pkgs="$pkgs $p==$(ver $p)"
done
# shellcheck disable=SC2086
download $pkgs
rm -rf .device/refbench && cp -r ../shared/refbench .device/ && chmod -R u+w .device/refbench
rm -f .device/refbench/data/sharegpt_sample.json
[ "${SKIP_REGEN:-0}" = 1 ] && { du -sh .whl .device; exit 0; }
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T=../shared/refbench/target-a-llama R=runs/regen
mkdir -p $R
$PY benchmarks/perturb_prompts.py --data ../shared/refbench/data/gsm8k_train.jsonl --num 300 --seed 0 --out $R/val_perturbed.jsonl
for part in train:../shared/refbench/data/gsm8k_train.jsonl val:$R/val_perturbed.jsonl; do
  name=${part%%:*} data=${part#*:}
  .venv/bin/eagle3 regenerate --target $T --data "$data" --out $R/$name --max-new-tokens 256 --temperature 0 \
    --max-model-len 1024 --batch-size 512 > $R/$name.json
  cp $R/$name/conversations.jsonl .device/regen/$name.jsonl
done
du -sh .whl .device
