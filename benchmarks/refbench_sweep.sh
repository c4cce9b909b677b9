#!/usr/bin/env bash
# refbench quality sweep on a GPU host without vLLM (the `device` H200 x2), all in one call:
#   prepare (train answers regenerated earlier by the target, greedy; validation = benchmarks/perturb_prompts.py
#   questions answered by the target) -> capture (hf) of every aux id 1..L-1 plus the last layer, once ->
#   vocab -> several drafts trained at once (VARIANTS below, spread over the GPUs), each picking its best
#   checkpoint by the replayed-rounds τ estimate on the validation capture -> export -> $OUT/{ranking.json,logs.tgz,draft-<top variants>.tgz}.
# Expects .whl/ (wheels for the GPU image's Python), .device/refbench/ (a copy of ../shared/refbench),
# .device/regen/{train,val}.jsonl (regenerated conversations): benchmarks/device_carry.sh makes all of them. EAGLE3_SRC overrides the package source dir,
# TRAIN_DATA the training conversations, WARMUP=0 skips the cache-warming trainer (few variants compile at once),
# DDP=1 trains the variants one after another, each data-parallel over all GPUs (torchrun), PROTOCOL_ROWS=N also
# captures the first N training conversations alone (see below). Each variant's torch.compile artifacts come back in
# compile-cache.tgz: unpacked into .device/ (-> .device/compile-cache/<variant>.bin) they skip most of the next
# call's compile for variants of the same name (COMPILE_CACHES points elsewhere). At most TOP_N=4 drafts fit beside them
# (8 files of <= 16 MiB come back: a draft over 16 MB comes in two parts, so TOP_N=2 for drafts of 3+ layers).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${EAGLE3_SRC:-$PWD/src} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/sweep-out}; S=/tmp/sweep-logs; mkdir -p "$OUT" "$S"  # $OUT: at most 8 files come back
W=runs/sweep T=.device/refbench/target-a-llama E="python3 -m eagle3.cli"
TRAIN_S=${TRAIN_S:-330} EPOCHS=${EPOCHS:-10}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}  # with CUDA_VISIBLE_DEVICES set, pass NGPU too
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u +%FT%TZ; } > "$S/gpu.txt" 2>&1
t0=$(date +%s)
# the capture goes to RAM (/dev/shm) when it has room: trainers on a VM disk stalled on page faults (docs/NOTES.md)
CAP=$W; [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 16000000 ] 2>/dev/null && CAP=/dev/shm/sweep
LAYERS=${LAYERS:-2,4,5,6}
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}  # several trainers compile at once
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONFAULTHANDLER=1  # a trainer stopped by the timeout (SIGABRT) prints every thread's stack
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(free -g | awk '/Mem/{print $3"G used"}')" | tee -a "$S/times.txt"; }
# the training set is split into CAPTURE_PARTS parts (default: one per GPU), each prepared and captured on its own
# GPU side by side; the trainers read them as one dataset (--captured A,B,...). The whole set is also prepared once,
# for the vocab's token frequencies and the reported counts.
TD=${TRAIN_DATA:-.device/regen/train.jsonl} P=${CAPTURE_PARTS:-$NGPU} CAPS=""
( $E prepare --target $T --data "$TD" --out $W/prepared --max-seq-len 1024 > "$S/prepare.json" 2>&1
  $E vocab --data $W/prepared --out $W/vocab --draft-vocab-size 4096 > "$S/vocab.json" 2>&1 ) &
( $E prepare --target $T --data .device/regen/val.jsonl --out $W/val_prepared --max-seq-len 1024 > "$S/val_prepare.json" 2>&1
  $E capture --target $T --data $W/val_prepared --out $CAP/val_captured --backend hf --device cuda:$((NGPU - 1)) \
    --layers $LAYERS --batch-tokens 65536 > "$S/val_capture.json" 2> "$S/val_capture.log" ) &
if [ -n "${PROTOCOL_ROWS:-}" ]; then  # the first PROTOCOL_ROWS conversations alone (the protocol's training set), with
  # their own vocab, for variants that must not see the extra prompts: flags --captured=@CAP@/captured-protocol
  # --vocab=@W@/vocab-protocol (@CAP@ and @W@ are replaced in VARIANTS)
  mkdir -p $W/parts; head -n "$PROTOCOL_ROWS" "$TD" > $W/parts/protocol.jsonl
  ( $E prepare --target $T --data $W/parts/protocol.jsonl --out $W/prepared-protocol --max-seq-len 1024 > "$S/prepare-protocol.json" 2>&1
    $E vocab --data $W/prepared-protocol --out $W/vocab-protocol --draft-vocab-size 4096 > "$S/vocab-protocol.json" 2>&1
    $E capture --target $T --data $W/prepared-protocol --out $CAP/captured-protocol --backend hf --device cuda:$((NGPU - 1)) \
      --layers $LAYERS --batch-tokens 65536 > "$S/capture-protocol.json" 2> "$S/capture-protocol.log" ) &
fi
for p in $(seq 0 $((P - 1))); do
  mkdir -p $W/parts; awk -v p=$p -v n=$P '(NR - 1) % n == p' "$TD" > $W/parts/train-$p.jsonl  # TRAIN_DATA: .jsonl
  ( $E prepare --target $T --data $W/parts/train-$p.jsonl --out $W/prepared-$p --max-seq-len 1024 > "$S/prepare-$p.json" 2>&1
    $E capture --target $T --data $W/prepared-$p --out $CAP/captured-$p --backend hf --device cuda:$((p % NGPU)) \
      --layers $LAYERS --batch-tokens 65536 > "$S/capture-$p.json" 2> "$S/capture-$p.log" ) &
  CAPS="$CAPS${CAPS:+,}$CAP/captured-$p"
done
wait; stamp captured
COMMON="--target $T --captured $CAPS --vocab $W/vocab --val-captured $CAP/val_captured --val-fraction 0.02
  --ttt-steps 7 --epochs $EPOCHS --lr 1e-3 --warmup-steps 100 --max-seq-len 2048 --batch-size 8 --eval-every 50
  --save-every 100000 --num-speculative-tokens 3 --preload"
VARIANTS=${VARIANTS:-"base:--layers=2,4,5
l248:--layers=2,4,8
l468:--layers=4,6,8
wide2k:--layers=2,4,5 --draft-intermediate-size=2048
wide4k:--layers=2,4,5 --draft-intermediate-size=4096
k3:--layers=2,4,5 --ttt-steps=3
head:--layers=2,4,5 --init-head-from-target
reg:--layers=2,4,5 --hidden-noise=0.1 --weight-decay=0.1"}
# one short trainer first: its train and eval compiles fill the inductor cache the variants then reuse
# (~85 s per process otherwise, all at once)
if [ "${WARMUP:-1}" = 1 ]; then
  timeout 300 $E train $COMMON --layers=2,4,5 --max-steps=2 --eval-every=1 --device cuda:0 --out $W/warmup \
    > "$S/warmup.train.json" 2> "$S/warmup.train.log"; stamp "warmed-up(rc=$?)"
fi
( while sleep 45; do stamp heartbeat; for f in "$S"/*.train.log; do echo "  $(basename "$f"): $(grep '^train:' "$f" | tail -n 1)"; done; done ) &
HB=$!
COMPILE_CACHES=${COMPILE_CACHES:-.device/compile-cache}
i=0
while IFS=: read -r name flags; do
  [ -z "$name" ] && continue
  flags=${flags//@CAP@/$CAP}; flags=${flags//@W@/$W}
  gpu=$(( i % NGPU )); i=$(( i + 1 ))
  if [ "${DDP:-0}" = 1 ]; then  # DDP=1: one variant at a time, data-parallel over all NGPU GPUs (torchrun)
    TRAIN="python3 -m torch.distributed.run --standalone --nproc_per_node $NGPU -m eagle3.cli train" DEV=cuda
  else
    TRAIN="$E train" DEV=cuda:$gpu
  fi
  # compile cache per variant: seeded from $COMPILE_CACHES/<name>.bin when an earlier call brought one back
  mkdir -p $W/compile-cache; [ -f "$COMPILE_CACHES/$name.bin" ] && cp "$COMPILE_CACHES/$name.bin" $W/compile-cache/
  ( timeout -s ABRT -k 15 "$TRAIN_S" $TRAIN $COMMON $flags --compile-cache $W/compile-cache/$name.bin --device $DEV --out $W/$name > "$S/$name.train.json" 2> "$S/$name.train.log"
    echo "train rc=$?" >> "$S/$name.train.log"
    $E export --checkpoint $W/$name/best --out $W/$name/draft --target $T > "$S/$name.export.json" 2>&1 ) &
  [ "${DDP:-0}" = 1 ] && wait $!
done <<< "$VARIANTS"
PIDS=$(jobs -p | grep -v "^$HB$"); [ -n "$PIDS" ] && wait $PIDS; kill $HB 2>/dev/null; stamp trained
rm -rf $W/warmup  # 2 steps: not a variant
# rank by the validation τ estimate of each best checkpoint; bring back the logs of all, the drafts of the top TOP_N
python3 - "$W" > "$OUT/ranking.json" <<'PY'
import json, sys
from pathlib import Path
rows = []
for meta in Path(sys.argv[1]).glob("*/best/eagle3_draft.json"):
    m = json.loads(meta.read_text())
    rows.append({"variant": meta.parent.parent.name, "step": m["step"], "tau_estimate": m["metrics"].get("tau_estimate"),
                 "tau_per_row": m["metrics"].get("tau_per_row"), "layers": m["aux_layer_ids"]})
print(json.dumps(sorted(rows, key=lambda r: -(r["tau_estimate"] or 0)), indent=1))
PY
cat "$OUT/ranking.json"; cp "$S/times.txt" "$OUT/"
tar czf "$OUT/logs.tgz" $W/*/logs $W/*/best/eagle3_draft.json $CAP/captured-*/manifest.json $CAP/val_captured/manifest.json \
  $W/vocab/coverage.json $W/vocab-protocol/coverage.json $W/prepared/manifest.json $W/prepared-protocol/manifest.json "$S"/*.json "$S"/*.txt "$S"/*.log 2>/dev/null
tar czf "$OUT/compile-cache.tgz" -C $W compile-cache  # unpack into .device/ to skip most compiles next call
for name in $(python3 -c "import json,sys; print(' '.join(r['variant'] for r in json.load(open(sys.argv[1]))[:int(sys.argv[2])]))" "$OUT/ranking.json" "${TOP_N:-4}"); do
  tar czf "$OUT/draft-$name.tgz" $W/$name/draft
  # a file over 16 MiB does not come back from the device: split deeper drafts (cat draft-X.tgz.part-* | tar xz)
  if [ "$(stat -c %s "$OUT/draft-$name.tgz")" -gt 16000000 ]; then
    split -b 15M "$OUT/draft-$name.tgz" "$OUT/draft-$name.tgz.part-" && rm "$OUT/draft-$name.tgz"
  fi
done
stamp packed; cp "$S/times.txt" "$OUT/"; ls -la "$OUT"; for f in "$S"/*.train.log; do echo "== $f"; grep "^train:" "$f" | tail -n 3; tail -n 2 "$f"; done
