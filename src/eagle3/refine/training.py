"""A round's training: `steps_per_round` optimizer steps of the trainer's own loop
(eagle3.train.loop), from the current draft, over a MixedLoader of rollout batches (weighted at
the rows the replay chose) and supervised batches of the training capture."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from eagle3.artifacts import CaptureManifest, DraftMetadata
from eagle3.refine.plan import Plan, output_metadata
from eagle3.refine.runtime import Runtime
from eagle3.splits import split_indices
from eagle3.train import parallel
from eagle3.train.data import PackedLoader, SelectedLayers, load_samples
from eagle3.train.loop import Run, TrainState, build_optimizer, save_final, train_loop
from eagle3.train.metrics import MetricsLog
from eagle3.train.onpolicy import MixedLoader, Replay, all_rows_weights
from eagle3.train.step import TTTModule


def training_rows(plan: Plan, samples, replay: Replay) -> tuple[list, list[int]]:
    """(per-sample step weights, the samples trained on): the replayed rounds' steps
    (`loss_rows: rounds`) or every row (`loss_rows: all`)."""
    if plan.cfg.loss_rows == "rounds":
        return replay.step_weights, replay.trained_samples()
    return all_rows_weights(samples, plan.train.loss.ttt_steps), list(range(len(samples)))


def train_round(
    plan: Plan, r: int, model, onpolicy, trained: list[int], out: Path, rt: Runtime, step0: int
) -> TrainState:
    """`steps_per_round` optimizer steps of the trainer's loop (eagle3.train.loop) over a
    MixedLoader of rollout and supervised batches; `out` gets the round's logs, final/ and its
    last checkpoint. Returns the loop's TrainState."""
    c, tc = plan.cfg, plan.train.model_copy(update={"out": out})
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(tc.seed + r)  # dropout and hidden noise, as the trainer seeds them
    loader = MixedLoader(
        *_loaders(plan, r, onpolicy, trained, rt.d.device.type == "cuda"), c.supervised_share
    )

    def meta(step: int, metrics: dict) -> DraftMetadata:
        return output_metadata(plan, step0 + step, metrics, {"round": r})

    mode = parallel.choose_parallel(tc.runtime.parallel, model, rt.d)  # as the trainer wraps it
    ttt = parallel.wrap(TTTModule(model), rt.d, fsdp=mode == "fsdp2")
    run = Run(
        cfg=tc,
        d=rt.d,
        out=out,
        model=model,
        ttt=ttt,
        parallel=mode,
        head=rt.head,
        loader=loader,
        val=[],
        heldout=[],
        total=c.steps_per_round,
        amp_dtype=rt.amp,
        aux_layer_ids=plan.aux_layer_ids,
        draft_metadata=meta,
    )
    build_optimizer(run)
    state, log = TrainState(), MetricsLog(out, rt.d.main)
    try:
        train_loop(run, state, log)
        save_final(run, state)
    finally:
        log.close()
        loader.close(finished=True)
    return state


def _loaders(
    plan: Plan, r: int, onpolicy, trained: list[int], cuda: bool
) -> tuple[PackedLoader, PackedLoader | None]:
    """(round r's rollout batches, the supervised capture's training rows' batches or None)."""
    tc = plan.train
    ahead = dict(
        prefetch=2 * tc.loader.num_workers if cuda else 0,
        num_workers=tc.loader.num_workers,
        pin_memory=cuda,
    )
    T, B = tc.loader.max_seq_len, tc.loader.batch_size
    rollouts = PackedLoader(onpolicy, trained, T, B, tc.seed + r, **ahead)
    if not plan.supervised:
        return rollouts, None
    sup = SelectedLayers(
        load_samples(plan.supervised, verify=False),
        CaptureManifest.load_combined(plan.supervised).aux_layer_ids,
        plan.aux_layer_ids,
        plan.num_layers,
    )
    keep, _ = split_indices(len(sup), tc.loader.val_fraction, tc.seed)  # not train's val rows
    return rollouts, PackedLoader(sup, keep, T, B, tc.seed + r, **ahead)
