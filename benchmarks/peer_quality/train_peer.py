#!/usr/bin/env python3
"""Train the peer, speculators 0.9.0, with its own trainer and default recipe; its checkpoint is the
draft.

    python benchmarks/peer_quality/train_peer.py --target T --data PEER_DATA --out OUT \
        --draft-vocab-size 8192 --aux-layer-ids 2,15,27 [--epochs 10] [--budget-s 780] \
        [-- EXTRA FLAGS]

PEER_DATA is what convert.py wrote. This runs `python -m speculators.train` (its CLI entry point,
unmodified) with only what the data and the comparison fix:
  --verifier-name-or-path T      the target (HF directory; the peer reads its config, embedding,
                                 lm_head, norm)
  --data-path PEER_DATA          offline hidden states, `file` backend; --on-missing raise (never
                                 ask a vLLM server)
  --draft-vocab-size V           ours; the peer builds d2t/t2d itself from PEER_DATA/token_freq.pt
                                 (its default)
  --target-layer-ids A B C       the capture's aux ids, in order (also its own default
                                 [2, L//2, L-3] here)
  --epochs 10                    the epochs its CLI reference's basic usage names (its schema
                                 default is 20)
  --train-data-ratio 0.98        the validation share of our recipe (its default 0.9 would train on
                                 8 % less)
  --seed 0, --save-path OUT/checkpoints, --log-dir OUT/logs
Everything else is its default (speculators 0.9.0 train/config/schema.py): one llama decoder layer,
draft arch from the verifier, norm_before_fc and norm_output on (eagle3 defaults),
norm_before_residual on, sliding window 2048, simple_flex_attention, loss kl_div (fused), TTT steps
3 with loss decay 1.0, Muon (lr 1e-3, momentum 0.95, weight decay 0.1, 5 Newton-Schulz steps,
match_rms_adamw) + AdamW (lr 1e-3, weight decay 0.01) for the rest, linear schedule with 1 %
warm-up, total_seq_len 8192 packed rows, 12 loader workers, bf16 autocast, grad clip 1.0, a
checkpoint per epoch, checkpoint_best by val loss.

The draft: the checkpoint the peer's trainer marks best (`checkpoints/checkpoint_best`, lowest
validation loss), else its last epoch; it is the peer's own `save_pretrained` output (speculators
format: config.json with speculators_model_type eagle3 + model.safetensors), copied as is to
OUT/draft (vLLM loads it directly). OUT/peer_train.json records the command, wall time, the
checkpoint picked and every epoch's val metrics. A run stopped by --budget-s keeps the epochs it
finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE_DEFAULTS = {
    "num_layers": 1,
    "norm_before_fc": True,
    "norm_output": True,
    "norm_before_residual": True,
    "fc_norm": False,
    "sliding_window": 2048,
    "draft_attn_impl": "simple_flex_attention",
    "loss_fn": "kl_div",
    "loss_implementation": "fused",
    "ttt_steps": 3,
    "ttt_step_loss_decay": 1.0,
    "optimizer": "muon",
    "lr": 1e-3,
    "muon_lr": 1e-3,
    "weight_decay": 0.01,
    "muon_weight_decay": 0.1,
    "muon_momentum": 0.95,
    "scheduler_type": "linear",
    "scheduler_warmup": "1 % of the steps",
    "total_seq_len": 8192,
    "num_workers": 12,
    "hidden_states_dtype": "bfloat16",
    "grad_clip": 1.0,
}


def peer_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "speculators.train",
        "--verifier-name-or-path",
        str(args.target),
        "--data-path",
        str(args.data),
        "--save-path",
        str(args.out / "checkpoints"),
        "--log-dir",
        str(args.out / "logs"),
        "--draft-vocab-size",
        str(args.draft_vocab_size),
        "--target-layer-ids",
        *args.aux_layer_ids.split(","),
        "--epochs",
        str(args.epochs),
        "--train-data-ratio",
        str(args.train_data_ratio),
        "--on-missing",
        "raise",
        "--seed",
        "0",
        *extra,
    ]


def epochs_done(ckpts: Path) -> list[int]:
    return (
        sorted(
            int(p.name)
            for p in ckpts.iterdir()
            if p.is_dir() and p.name.isdigit() and (p / "model.safetensors").is_file()
        )
        if ckpts.is_dir()
        else []
    )


def pick_checkpoint(ckpts: Path) -> tuple[Path | None, str]:
    best = ckpts / "checkpoint_best"
    if best.is_symlink() and (best.resolve() / "model.safetensors").is_file():
        return best.resolve(), "checkpoint_best (lowest validation loss, the peer's own pick)"
    done = epochs_done(ckpts)
    if done:
        return ckpts / str(done[-1]), "last finished epoch (no checkpoint_best)"
    return None, "no finished epoch"


def val_metrics(ckpts: Path) -> dict[str, Any]:
    out = {}
    for e in epochs_done(ckpts):
        p = ckpts / str(e) / "val_metrics.json"
        if p.is_file():
            out[str(e)] = json.loads(p.read_text())
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path, help="convert.py's output")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--draft-vocab-size", required=True, type=int)
    ap.add_argument("--aux-layer-ids", required=True, help="comma-separated, the capture's order")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--train-data-ratio", type=float, default=0.98)
    ap.add_argument(
        "--budget-s", type=float, default=None, help="stop the trainer after this many seconds"
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = peer_command(args, extra)
    env = {
        **os.environ,
        "TORCHDYNAMO_SUPPRESS_ERRORS": os.environ.get("TORCHDYNAMO_SUPPRESS_ERRORS", "1"),
    }
    t0 = time.time()
    with open(args.out / "train.log", "w") as log:
        try:
            rc = subprocess.call(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.budget_s
            )
        except subprocess.TimeoutExpired:
            rc = "budget"
    wall_s = round(time.time() - t0, 1)
    ckpts = args.out / "checkpoints"
    picked, why = pick_checkpoint(ckpts)
    draft = args.out / "draft"
    if picked is not None:
        shutil.rmtree(draft, ignore_errors=True)
        draft.mkdir(parents=True)
        for f in ("config.json", "model.safetensors", "generation_config.json"):
            if (picked / f).is_file():
                shutil.copy2(picked / f, draft / f)
    record = {
        "command": cmd,
        "rc": rc,
        "wall_s": wall_s,
        "epochs_requested": args.epochs,
        "epochs_done": len(epochs_done(ckpts)),
        "checkpoint": str(picked) if picked else None,
        "checkpoint_rule": why,
        "draft": str(draft) if picked else None,
        "val_metrics_by_epoch": val_metrics(ckpts),
        "recipe_defaults": RECIPE_DEFAULTS,
        "env": {"TORCHDYNAMO_SUPPRESS_ERRORS": env["TORCHDYNAMO_SUPPRESS_ERRORS"]},
    }
    (args.out / "peer_train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    sys.exit(0 if picked is not None else 1)


if __name__ == "__main__":
    main()
