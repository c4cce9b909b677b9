#!/usr/bin/env bash
# The GPU host without internet, one device call at a time (benchmarks/README.md, "A GPU host
# without internet"). What a call carries comes from benchmarks/offline_gpu/pack.py; everything
# lives under $EAGLE3_GPU_HOST_DIR (default /tmp/eagle3-gpu-host), which survives between calls
# to the same warm machine, as do processes started by `start`.
#
#   bash benchmarks/offline_gpu/host.sh stage            # parks the part folders this call carried
#                                                        #   (.device/NAME_i)
#   bash benchmarks/offline_gpu/host.sh install          # joins each pack whose parts are all
#                                                        #   here, checks its sha256, installs its
#                                                        #   wheels under the host dir; names the
#                                                        #   missing parts otherwise
#   bash benchmarks/offline_gpu/host.sh run [--budget-s S] -- CMD ...
#                                                        # CMD in the foreground, in this call
#   bash benchmarks/offline_gpu/host.sh start RUN -- CMD ...
#                                                        # CMD detached (setsid: it outlives the
#                                                        #   call) in a copy of this checkout
#   bash benchmarks/offline_gpu/host.sh wait RUN [S]     # up to S s (500) for it; its log tail
#   bash benchmarks/offline_gpu/host.sh collect RUN [N]  # the N-th group of 4 pieces (<= 15 MiB
#                                                        #   each) of the run's out/ into $OUT
#                                                        #   (N = 0 packs out/ as it is now)
#
# CMD runs with every installed pack's site and this checkout's src/ on PYTHONPATH, the Hugging
# Face libraries offline, EAGLE3_CARRIED=<host dir>/packs (a pack's files: $EAGLE3_CARRIED/NAME/
# files/...) and, under `start`, RUN_DIR=<host dir>/runs/RUN (what it writes to $RUN_DIR/out comes
# back through `collect`; $RUN_DIR/out/timings.txt is shown by `wait`).
set -uo pipefail
cd "$(dirname "$0")/../.."
H=${EAGLE3_GPU_HOST_DIR:-/tmp/eagle3-gpu-host}
OUT=${OUT:-$H/out}
PER_CALL=4  # pieces a `collect` brings back: a call returns at most 64 MiB
mkdir -p "$H/parts" "$H/packs" "$H/runs" "$OUT"
die() { echo "host.sh: $*" >&2; exit 1; }
field() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

cmd_stage() {
  local n=0 d name
  for d in .device/*_[0-9]*; do
    [ -f "$d/manifest.json" ] || continue
    name=$(field "$d/manifest.json" name)
    mkdir -p "$H/parts/$name" && cp "$d"/part.* "$d/manifest.json" "$H/parts/$name/" \
      && n=$((n + 1))
  done
  [ "$n" -gt 0 ] || die "stage: no .device/NAME_i part folder came with this call (carry one)"
  for d in "$H"/parts/*/; do echo "staged $(basename "$d"): $(cd "$d" && ls part.* | xargs)"; done
}

cmd_install() {
  local d name num sha i missing installed=0
  for d in "$H"/parts/*/; do
    name=$(basename "$d")
    [ -f "$H/packs/$name/ready" ] && { echo "$name: installed"; installed=1; continue; }
    num=$(field "$d/manifest.json" num_parts) sha=$(field "$d/manifest.json" sha256) missing=""
    for i in $(seq 1 "$num"); do
      [ -f "$d/part.$(printf %02d "$i")" ] || missing="$missing $i"
    done
    [ -z "$missing" ] || die "$name: parts missing:$missing of $num (the machine went back" \
      "between the calls? stage them all again)"
    cat "$d"/part.* > "$H/$name.tar.gz"
    echo "$sha  $H/$name.tar.gz" | sha256sum -c --quiet || die "$name: the parts fail their sha256"
    rm -rf "$H/packs/$name" && mkdir -p "$H/packs/$name"
    tar -xzf "$H/$name.tar.gz" -C "$H/packs/$name" && rm "$H/$name.tar.gz" "$d"/part.*
    if ls "$H/packs/$name"/wheels/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$H/packs/$name/site" "$H/packs/$name"/wheels/*.whl \
        || die "$name: installing its wheels failed"
    fi
    date -u +%FT%TZ > "$H/packs/$name/ready" && echo "$name: installed" && installed=1
  done
  [ "$installed" = 1 ] || die "install: nothing staged on this machine"
}

use_packs() {  # the environment CMD runs in
  local site path=""
  for site in "$H"/packs/*/site; do [ -d "$site" ] && path="$path$site:"; done
  export PYTHONPATH="$path$PWD/src${PYTHONPATH:+:$PYTHONPATH}" EAGLE3_CARRIED=$H/packs
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false
  # vLLM on the image: spawned workers (decision 0023), no FlashInfer sampler (its kernels compile
  # at first use, and the image has no nvcc)
  export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn}
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
}

machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  date -u +%FT%TZ
}

cmd_run() {
  local budget=100000
  [ "${1:-}" = "--budget-s" ] && { budget=$2; shift 2; }
  [ "${1:-}" = -- ] && shift
  [ $# -gt 0 ] || die "run: no command after --"
  use_packs; machine
  timeout -k 5 "$budget" "$@"
}

alive() { pgrep -f "eagle3-gpu-host-run $1 " > /dev/null; }

cmd_start() {
  local run=${1:?RUN: a name for the detached run}; shift
  [ "${1:-}" = -- ] && shift
  [ $# -gt 0 ] || die "start: no command after --"
  alive "$run" && die "start: $run is already running"
  local dir=$H/runs/$run
  rm -rf "$dir/code" && mkdir -p "$dir/code" "$dir/out"
  cp -r src benchmarks configs "$dir/code/"
  mkdir -p "$dir/code/tests" && cp -r tests/fixtures "$dir/code/tests/"
  machine > "$dir/out/machine.txt"
  (cd "$dir/code" && use_packs && RUN_DIR=$dir setsid nohup bash -c \
    '"$@" > "$RUN_DIR/run.log" 2>&1; echo $? > "$RUN_DIR/rc"' "eagle3-gpu-host-run $run " \
    "$@" < /dev/null > /dev/null 2>&1 &)
  sleep 1
  alive "$run" || [ -f "$dir/rc" ] || die "start: $run did not start"
  echo "started $run"
}

cmd_wait() {
  local run=${1:?RUN} until=$((SECONDS + ${2:-500})) dir=$H/runs/${1:?}
  while [ $SECONDS -lt $until ] && alive "$run"; do sleep 5; done
  cat "$dir/out/timings.txt" 2>/dev/null; tail -n 5 "$dir/run.log"
  if [ -f "$dir/rc" ]; then echo "$run ended: rc=$(cat "$dir/rc")"; else echo "$run: running"; fi
}

cmd_collect() {
  local run=${1:?RUN} n=${2:-0} dir=$H/runs/${1:?} i=0 f
  if [ "$n" = 0 ] || [ ! -d "$dir/pack" ]; then  # out/ as it is now, in <= 15 MiB pieces
    rm -rf "$dir/pack" && mkdir -p "$dir/pack"
    XZ_OPT=-T0 tar cJf "$dir/pack/out.tar.xz" -C "$dir" --ignore-failed-read out run.log rc \
      2> /dev/null
    (cd "$dir/pack" && split -b 15M -d out.tar.xz out.tar.xz.part && rm out.tar.xz)
  fi
  for f in "$dir"/pack/*; do
    [ $((i / PER_CALL)) -eq "$n" ] && cp "$f" "$OUT/"
    i=$((i + 1))
  done
  echo "collect $run $n: $(ls "$OUT" | xargs) (of $i pieces; here: cat out.tar.xz.part* | tar xJ)"
}

case "${1:-}" in
  stage) cmd_stage ;;
  install) cmd_install ;;
  run) shift; cmd_run "$@" ;;
  start) shift; cmd_start "$@" ;;
  wait) shift; cmd_wait "$@" ;;
  collect) shift; cmd_collect "$@" ;;
  *) die "usage: host.sh stage|install|run [--budget-s S] -- CMD|start RUN -- CMD|wait RUN [S]" \
    "|collect RUN [N]" ;;
esac
