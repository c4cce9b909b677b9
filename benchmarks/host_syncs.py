#!/usr/bin/env python3
"""Where does one fast training step synchronise the host with the GPU? Prints the Python stack of
every synchronizing CUDA call (torch.cuda sync-debug mode) in one step after warm-up. CUDA only;
torch only.

    PYTHONPATH=src python3 benchmarks/host_syncs.py --seq 1024 --ttt-steps 3
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eagle3.model.draft import DraftConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_setup import build_benchmark, run_benchmark_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the per-step blocks, as the benchmark does",
    )
    a = ap.parse_args()
    cfg = DraftConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        vocab_size=32000,
        draft_vocab_size=4096,
        target_hidden_size=512,
        num_aux=3,
        rope_theta=500000.0,
    )
    s = build_benchmark(cfg, seq_len=a.seq, steps=a.ttt_steps, device="cuda", compile=a.compile)
    for _ in range(2):
        run_benchmark_step(s)
    torch.cuda.synchronize()
    stacks = []

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.format_stack()[:-2]
        if "synchroniz" in str(message).lower() and "set_sync_debug_mode" not in "".join(
            stack[-2:]
        ):
            stacks.append(
                "".join(stack[-8:])
            )  # (switching the mode itself warns once: not a sync of the step)

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run_benchmark_step(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"{len(stacks)} synchronizing call(s) in one step")
    for i, st in enumerate(stacks):
        print(f"--- sync {i + 1}\n{st}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
