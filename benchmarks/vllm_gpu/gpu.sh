#!/usr/bin/env bash
# The capture on a real GPU vLLM, on a GPU host whose image has torch but no vLLM (the H200 device
# host: torch 2.11.0+cu130, Python 3.12, nothing fetched there). vLLM 0.26.0 pins that torch.
#
# Here, once: `.venv/bin/python benchmarks/vllm_gpu/closure.py --vllm 0.26.0` writes vLLM (pruned)
# and the wheels the image lacks, as one tar.gz in parts of 58 MB, .device/vllm_gpu_1, _2, ...
# (git-ignored; each part folder holds the manifest). Then device calls to ONE warm machine (it
# stays warm ~30 s after a call: send the next at once; /tmp survives between calls):
#
#   bash benchmarks/vllm_gpu/gpu.sh stage       # every call, carrying one part folder: parks it
#   bash benchmarks/vllm_gpu/gpu.sh install     # (after the last part) joins the parts, checks the
#                                               #   sha256, unpacks vLLM and installs the wheels
#                                               #   under /tmp (--target: the image stays as is)
#   bash benchmarks/vllm_gpu/gpu.sh touchpoints # the static check on the vLLM it installed
#   bash benchmarks/vllm_gpu/gpu.sh prove [DIR] # the last call in one command: stage, install,
#                                               #   touchpoints, then golden on V2 and on V1, in
#                                               #   float32 and bfloat16 (tiny targets + DIR, a
#                                               #   real model), packed into $OUT/golden.tgz
#   bash benchmarks/vllm_gpu/gpu.sh golden RUNNER DTYPE [TARGETS] [TARGET_DIR]
#                                               # the golden capture check (benchmarks/
#                                               #   vllm_golden.py) on Model Runner V2 (RUNNER=1)
#                                               #   or V1 (0), float32 or bfloat16; its JSON and
#                                               #   log into $S/golden
#
# `install` stops at once, naming the missing parts, when the machine went back between the
# staging calls (start again from the first part).
set -uo pipefail
cd "$(dirname "$0")/../.."
S=${EAGLE3_VLLM_GPU_DIR:-/tmp/eagle3-vllm-gpu}
OUT=${OUT:-$S/out}
mkdir -p "$S/parts" "$OUT"
die() { echo "gpu.sh: $*" >&2; exit 1; }

use_site() {
  [ -f "$S/ready" ] || die "no vLLM installed on this machine yet: stage every part, then install"
  export PYTHONPATH="$S/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export PYTHONUNBUFFERED=1
  # the golden check computes its reference on the GPU in the process that starts the engine
  export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn}
}

cmd_stage() {
  local n=0
  for d in .device/vllm_gpu_[0-9]*; do
    [ -d "$d" ] || continue
    cp "$d"/part.* "$d/manifest.json" "$S/parts/" && n=$((n + 1))
  done
  [ "$n" -gt 0 ] || die "no .device/vllm_gpu_* folder came with this call (name one in carry)"
  echo "staged: $(cd "$S/parts" && ls part.* | tr '\n' ' ')"
}

cmd_install() {
  [ -f "$S/ready" ] && { echo "already installed: $(cat "$S/ready")"; return 0; }
  local m=$S/parts/manifest.json
  [ -f "$m" ] || die "no part staged on this machine"
  local num sha
  num=$(python3 -c "import json; print(json.load(open('$m'))['num_parts'])")
  sha=$(python3 -c "import json; print(json.load(open('$m'))['sha256'])")
  local missing=()
  for i in $(seq 1 "$num"); do
    [ -f "$S/parts/part.$(printf %02d "$i")" ] || missing+=("$i")
  done
  [ ${#missing[@]} -eq 0 ] || die "parts missing: ${missing[*]} (of $num; the machine went back?)"
  cat "$S"/parts/part.* > "$S/vllm_gpu.tar.gz"
  echo "$sha  $S/vllm_gpu.tar.gz" | sha256sum -c --quiet || die "the joined parts fail their sha256"
  rm -rf "$S/site" "$S/wheels"
  tar -xzf "$S/vllm_gpu.tar.gz" -C "$S" && rm "$S/vllm_gpu.tar.gz" "$S"/parts/part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" \
    "$S"/wheels/*.whl || die "installing the carried wheels failed"
  PYTHONPATH="$S/site" python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', \
torch.__version__, torch.cuda.get_device_name(0))" || die "vllm does not import"
  PYTHONPATH="$S/site" python3 -c "import vllm; print(vllm.__version__)" > "$S/ready"
}

G=$S/golden  # the checks' JSON and logs; `prove` packs them into $OUT/golden.tgz (a call brings
             #   back at most 8 files)
mkdir -p "$G"

cmd_touchpoints() {
  use_site
  python3 benchmarks/vllm_touchpoints.py --installed -v 2>&1 | tee "$G/touchpoints.log"
}

cmd_golden() {
  local runner=${1:?RUNNER: 1 (Model Runner V2) or 0 (V1)} dtype=${2:-float32}
  local targets=${3:-llama,qwen3_moe,deepseek_v3} target_dir=${4:-}
  use_site
  local name=golden_v$([ "$runner" = 1 ] && echo 2 || echo 1)_$dtype
  VLLM_USE_V2_MODEL_RUNNER=$runner python3 benchmarks/vllm_golden.py "$G/$name.json" \
    --dtype "$dtype" --targets "$targets" ${target_dir:+--target-dir "$target_dir"} \
    > "$G/$name.log" 2>&1
  tail -n 8 "$G/$name.log"
}

cmd_prove() {  # [TARGET_DIR]: every part staged, then install, touchpoints and the golden check
  # on both runners in float32 and bfloat16, the tiny targets and TARGET_DIR (a real model), while
  # the call has time left (DEADLINE_S, seconds since the call began: a check that would start
  # later is skipped and said)
  cmd_stage && cmd_install || exit 1
  cmd_touchpoints > /dev/null; tail -n 2 "$G/touchpoints.log"
  local run
  for run in "1 float32" "0 float32" "1 bfloat16" "0 bfloat16"; do
    if [ "$SECONDS" -gt "${DEADLINE_S:-420}" ]; then
      echo "skipped (deadline): golden $run"; continue
    fi
    # shellcheck disable=SC2086
    cmd_golden $run llama,qwen3_moe,deepseek_v3 "${1:-}"
  done
  tar czf "$OUT/golden.tgz" -C "$S" golden
}

case "${1:-}" in
  prove) shift; cmd_prove "$@" ;;
  stage) cmd_stage ;;
  install) cmd_install ;;
  touchpoints) cmd_touchpoints ;;
  golden) shift; cmd_golden "$@" ;;
  *) die "usage: gpu.sh stage|install|touchpoints|prove|golden RUNNER DTYPE [TARGETS] [DIR]" ;;
esac
