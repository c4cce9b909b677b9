#!/usr/bin/env bash
# The main job on the offline embedded default: builds/updates .venv, then runs the whole pipeline
# (prepare -> regenerate -> capture -> vocab -> train -> export -> evaluate) on configs/demo.yaml,
# a tiny target built locally, with no server and no network.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/eagle3 run --config "${1:-configs/demo.yaml}"
