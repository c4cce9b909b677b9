#!/usr/bin/env bash
# The test command (README, .ci/run): builds/updates .venv, then runs the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check src tests flows tasks blocks benchmarks
exec .venv/bin/python -m pytest "$@"
