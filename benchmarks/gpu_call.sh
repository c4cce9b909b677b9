#!/usr/bin/env bash
# One GPU call, generically: the GPU host (an H200 machine reached one command at a time) has no
# vLLM, no pydantic and no datasets, and reaches no network; what a call needs travels with it as
# git-ignored "carry" dirs.
#
#   bash benchmarks/gpu_call.sh carry [refbench|peer] [--skip-regen]
#                                     # HERE (CPU host): build the carry
#   bash benchmarks/gpu_call.sh run [--budget-s N] [--out DIR] [--pack "PATH ..."] [--dry-run] \
#        -- COMMAND [ARG ...]         # ON THE GPU: run one command
#
# carry refbench  .whl/ (wheels the GPU image lacks: pydantic, datasets and their needs, at the
#                 versions .venv holds, for the image's Python 3.12), .device/refbench/ (a copy of
#                 ../shared/refbench, ShareGPT sample left out) and, unless --skip-regen,
#                 .device/regen/{train,val}.jsonl: the protocol's training set (every GSM8K-train
#                 question answered greedy, <= 256 new tokens, by the target through this host's
#                 vLLM, ~15 min on 2 cores) and the 300 perturbed validation prompts
#                 (benchmarks/perturb_prompts.py, seed 0) answered the same way. The call then
#                 carries [".whl", ".device"].
# carry peer      .whl/ += speculators==0.9.0 and its needs, .peerbench/ = ../shared/peerbench: what
#                 benchmarks/gpu_step_vs_peer.sh carries ([".whl", ".peerbench"]).
# run             installs .whl/*.whl (when carried) into /tmp/eagle3-site, exports PYTHONPATH
#                 (site + src) and the offline variables, writes $OUT/gpu.txt (nvidia-smi, date),
#                 runs COMMAND under `timeout --budget-s` (default 480) with stdout to
#                 $OUT/command.out and the last 2 MB of stderr to $OUT/command.log, then packs the
#                 --pack paths (files or dirs, missing ones skipped) into $OUT/pack.tgz. $OUT
#                 defaults to /tmp/gpu-call-out; exits with COMMAND's status. --dry-run prints what
#                 it would run and stops.
#
# Examples (benchmarks/README.md has the list):
#   bash benchmarks/gpu_call.sh run --budget-s 480 \
#        --pack "runs/refbench-gpu/draft runs/refbench-gpu/train/logs" -- \
#        python3 -m eagle3.cli run --no-prefect --config configs/refbench-gpu.yaml
#   bash benchmarks/gpu_call.sh run --budget-s 560 -- \
#        bash benchmarks/gpu_step_vs_peer.sh --budget-s 500
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,10p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
verb=$1; shift

if [ "$verb" = carry ]; then
  what=refbench skip_regen=0
  while [ $# -gt 0 ]; do
    case $1 in refbench|peer) what=$1 ;; --skip-regen) skip_regen=1 ;; *) usage ;; esac; shift
  done
  set -e
  PY=${PY:-.venv/bin/python}
  ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
  download() {  # shellcheck disable=SC2068
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl $@
  }
  mkdir -p .whl
  if [ "$what" = peer ]; then
    pkgs="speculators==0.9.0"
    for p in loguru pydantic pydantic_core pydantic-settings python-dotenv annotated-types \
        typing-inspection typing_extensions; do
      pkgs="$pkgs $p==$(ver $p)"
    done
    download $pkgs  # shellcheck disable=SC2086
    rm -rf .peerbench && cp -r ../shared/peerbench .peerbench && chmod -R u+w .peerbench
    du -sh .whl .peerbench
    exit 0
  fi
  rm -f .whl/*.whl && mkdir -p .device/regen
  pkgs=""
  for p in pydantic pydantic_core annotated-types typing-inspection typing_extensions datasets \
      dill multiprocess; do
    pkgs="$pkgs $p==$(ver $p)"
  done
  download $pkgs  # shellcheck disable=SC2086
  rm -rf .device/refbench && cp -r ../shared/refbench .device/ && chmod -R u+w .device/refbench
  rm -f .device/refbench/data/sharegpt_sample.json
  [ "$skip_regen" = 1 ] && { du -sh .whl .device; exit 0; }
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  T=../shared/refbench/target-a-llama R=runs/regen
  mkdir -p $R
  $PY benchmarks/perturb_prompts.py --data ../shared/refbench/data/gsm8k_train.jsonl --num 300 \
    --seed 0 --out $R/val_perturbed.jsonl
  for part in train:../shared/refbench/data/gsm8k_train.jsonl val:$R/val_perturbed.jsonl; do
    name=${part%%:*} data=${part#*:}
    .venv/bin/eagle3 regenerate --target $T --data "$data" --out $R/$name --max-new-tokens 256 \
      --temperature 0 --max-model-len 1024 --batch-size 512 > $R/$name.json
    cp $R/$name/conversations.jsonl .device/regen/$name.jsonl
  done
  du -sh .whl .device
  exit 0
fi

[ "$verb" = run ] || usage
budget=480 out=${OUT:-/tmp/gpu-call-out} pack="" dry=0
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --budget-s) budget=$2; shift ;;
    --out) out=$2; shift ;;
    --pack) pack=$2; shift ;;
    --dry-run) dry=1 ;;
    *) usage ;;
  esac
  shift
done
[ "${1:-}" = -- ] && shift
[ $# -ge 1 ] || { echo "gpu_call.sh run: no COMMAND after --" >&2; exit 2; }
if [ "$dry" = 1 ]; then
  echo "out=$out budget_s=$budget pack=[$pack] wheels=$(ls .whl/*.whl 2>/dev/null | wc -l)"
  printf '%q ' timeout "$budget" "$@"; echo
  exit 0
fi
SITE=/tmp/eagle3-site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $SITE .whl/*.whl || exit 1
fi
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; date -u +%FT%TZ; } \
  > "$out/gpu.txt"
timeout "$budget" "$@" > "$out/command.out" 2> "$out/command.err"
rc=$?
echo "rc=$rc after $(date -u +%FT%TZ)" >> "$out/command.err"
tail -c 2000000 "$out/command.err" > "$out/command.log" && rm "$out/command.err"
if [ -n "$pack" ]; then
  # shellcheck disable=SC2086
  tar czf "$out/pack.tgz" --ignore-failed-read $pack 2>> "$out/command.log"
fi
ls -la "$out"
exit $rc
