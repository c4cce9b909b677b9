"""The training loop: optimizer steps, validation, checkpoints, over what `run_train` built (a
`Run`).

Loss normalisation: each micro-batch's loss is sum_j loss_decay**j * (mean soft-CE over its
supervised, in-draft-vocab rows of step j); micro-batches are averaged (/grad_accum) and DDP/FSDP
average over ranks. Resume restores weights, optimizer, scheduler, step, loader (epoch, cursor) and
RNG, so N steps straight == N/2 + resume + N/2 bit-exactly on CPU fp32 (tests/test_train.py).
Checkpoints hold the full weights and optimizer state, so a run resumes at another world size or
wrapping (ddp, fsdp2, one process) as long as the rows per step (batch_size x grad_accum x world)
stay the same: the same rows then make each step, and only the order of the floating-point sums
differs (tests/test_multi_gpu_train.py, gloo on the CPU).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts import DraftMetadata
from eagle3.config import DEFAULT_NUM_SPECULATIVE_TOKENS, ConfigError, TrainConfig
from eagle3.config.train_options import ScheduleOptions
from eagle3.integrity import nonfinite_tensors
from eagle3.model.family import DraftModel
from eagle3.train import parallel
from eagle3.train.average import WeightAverage
from eagle3.train.checkpoint import (
    RAW_WEIGHTS,
    WEIGHTS,
    check_draft_weights,
    prune_checkpoints,
    read_checkpoint,
    read_latest_good_checkpoint,
    save_checkpoint,
    save_compile_cache,
    save_model_dir,
)
from eagle3.train.estimate import score_batches, tau_from_metrics
from eagle3.train.loss import TargetHead
from eagle3.train.metrics import MetricsLog, progress
from eagle3.train.resume_inputs import check_resume
from eagle3.train.step import STAT_COLUMNS, summarize


class NonFiniteError(ValueError):
    """Training met NaN/inf (in a batch's hidden states, the loss or the gradient) more often than
    max_nonfinite_steps allows."""


@dataclass
class Run:
    """Everything the loop reads, built once by run_train."""

    cfg: TrainConfig
    d: parallel.Dist
    out: Path
    model: DraftModel
    ttt: torch.nn.Module  # TTTModule(model), wrapped for DDP/FSDP
    parallel: str  # how ttt is wrapped: none, ddp or fsdp2 (eagle3.train.parallel.choose_parallel)
    head: TargetHead
    loader: Any  # PackedLoader or a streaming loader
    val: list  # validation batches (they pick best/)
    heldout: list  # the held-out train split, logged only, when val_captured validates
    total: int  # optimizer steps of the whole run
    amp_dtype: torch.dtype
    aux_layer_ids: list[int]
    #: (step, validation metrics) -> eagle3_draft.json
    draft_metadata: Callable[[int, dict], DraftMetadata]
    params: list[torch.nn.Parameter] = field(default_factory=list)
    opt: torch.optim.Optimizer | None = None
    sched: Any = None
    ema: WeightAverage | None = None
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def optim_shard(self) -> str | None:
        """This rank's optimizer file in a checkpoint of the per-rank FSDP layout of earlier
        versions (read only)."""
        return f"rank-{self.d.rank}-of-{self.d.world}.pt" if self.parallel == "fsdp2" else None

    @property
    def global_batch_rows(self) -> int:
        """Packed rows per optimizer step, over every rank and micro-batch."""
        return self.cfg.loader.batch_size * self.cfg.loader.grad_accum * self.d.world

    def layout(self) -> dict[str, Any]:
        """How the steps were split (trainer_state.json): a resume must keep global_batch_rows."""
        return {
            "world_size": self.d.world,
            "parallel": self.parallel,
            "batch_size": self.cfg.loader.batch_size,
            "grad_accum": self.cfg.loader.grad_accum,
            "global_batch_rows": self.global_batch_rows,
        }


@dataclass
class TrainState:
    """What the loop advances (and a checkpoint's trainer_state.json records)."""

    step: int = 0
    best: float = -1.0  # best validation tau_estimate so far
    num_skipped: int = 0  # non-finite steps skipped
    last_loss: float | None = None
    val_metrics: dict[str, float] = field(default_factory=dict)


def lr_lambda(schedule: ScheduleOptions, total: int):
    """The lr factor at each step of a `total`-step run: linear warmup, then schedule.decay down to
    schedule.min_lr_ratio."""
    warmup, floor = schedule.warmup_steps, schedule.min_lr_ratio

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule.decay == "constant":
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * t)) if schedule.decay == "cosine" else 1 - t
        return floor + (1 - floor) * decay

    return f


def build_optimizer(run: Run) -> None:
    """AdamW over the trainable parameters (train.optimizer), the lr schedule (train.schedule) and
    the weight average (train.checkpoint.ema_decay > 0)."""
    opt, ema_decay = run.cfg.optimizer, run.cfg.checkpoint.ema_decay
    run.params = [p for p in run.model.parameters() if p.requires_grad]
    # fused: one kernel over all tensors on CUDA (the step's AdamW 8.4 ms vs its 2.8 ms byte floor
    # in the H200 profile, docs/history/); FSDP2's sharded DTensor params keep the default (foreach)
    # path
    fused = run.d.device.type == "cuda" and run.parallel != "fsdp2"
    run.opt = torch.optim.AdamW(
        run.params,
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        weight_decay=opt.weight_decay,
        fused=fused or None,
    )
    run.sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lr_lambda(run.cfg.schedule, run.total))
    run.ema = WeightAverage(run.params, ema_decay) if ema_decay > 0 else None


def add_hidden_noise(aux: torch.Tensor, num_aux: int, scale: float) -> torch.Tensor:
    """aux (B, T, A*H) + N(0, (scale * rms)^2) per state, rms taken over each state's H features."""
    x = aux.unflatten(-1, (num_aux, -1))  # (B, T, A, H)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # (B, T, A, 1)
    return (x + (torch.randn_like(x, dtype=torch.float32) * rms * scale).to(x.dtype)).flatten(
        -2
    )  # (B, T, A*H)


# ------------------------------------------------------------------------------------------ weights


def averaged(run: Run):
    """Context in which the model holds the weight average, when there is one (validation,
    saving)."""
    return run.ema.applied() if run.ema is not None else nullcontext()


def gather_weights(run: Run) -> dict[str, torch.Tensor]:
    """The full state to save: the weight average when there is one."""
    if run.ema is None:
        return parallel.full_state_dict(run.ttt, run.d)
    with (
        run.ema.applied()
    ):  # copies: a state dict may share the parameters' storage, which the swap back rewrites
        return {k: v.detach().clone() for k, v in parallel.full_state_dict(run.ttt, run.d).items()}


def load_weights(run: Run, sd: dict[str, torch.Tensor], path: Path) -> None:
    check_draft_weights(run.model, sd, path)
    parallel.load_full_state_dict(run.ttt, {"draft." + k: v for k, v in sd.items()}, run.d)


def refuse_nonfinite(sd: dict[str, torch.Tensor], where: str, step: int) -> None:
    bad = nonfinite_tensors(sd)
    if bad:
        raise NonFiniteError(
            f"step {step}: the draft weights to be saved as {where} hold NaN/inf "
            f"({', '.join(bad[:4])}); nothing was written. Training diverged: lower "
            "optimizer.lr, raise schedule.warmup_steps or check the capture"
        )


def resume(run: Run) -> TrainState:
    """The state of the newest checkpoint of run.out that reads back whole (every rank: the oldest
    any rank could read), applied to model, optimizer, scheduler, loader and RNG; a fresh state when
    there is none."""
    d = run.d
    ck = read_latest_good_checkpoint(run.out, d.device, run.optim_shard, lambda m: progress(d, m))
    if d.world > 1:
        got = torch.tensor([ck.trainer_state["step"] if ck is not None else -1], device=d.device)
        torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MIN)
        if ck is not None and int(got.item()) != ck.trainer_state["step"]:
            ck = (
                read_checkpoint(
                    run.out / "checkpoints" / f"step-{int(got.item())}", d.device, run.optim_shard
                )
                if int(got.item()) >= 0
                else None
            )
    if ck is None:
        return TrainState()
    check_resume(run.cfg, ck.path, ck.meta, run.draft_metadata(ck.trainer_state["step"], {}))
    load_weights(run, ck.weights, ck.path / WEIGHTS)
    if (
        run.ema is not None
    ):  # model.safetensors holds the average (or, from a run without one, the weights)
        run.ema.reset()
        if ck.raw is not None:
            load_weights(run, ck.raw, ck.path / RAW_WEIGHTS)
    st = ck.trainer_state
    check_layout(run, st, ck.path)
    if ck.optimizer_is_shard:  # the per-rank FSDP layout of earlier versions: this rank's own shard
        run.opt.load_state_dict(ck.optimizer)
    else:
        parallel.load_full_optimizer_state(run.opt, ck.optimizer, str(ck.path / "optimizer.pt"))
    run.sched.load_state_dict(ck.scheduler)
    apply_optimizer_settings(run)
    run.loader.load_state_dict(st)
    was = st.get("world_size")
    progress(
        d,
        f"resumed from {ck.path} (step {st['step']}"
        + (f", written by {was} process(es), {st.get('parallel')}" if was is not None else "")
        + ")",
    )
    torch.set_rng_state(ck.rng["torch"])
    random.setstate(ck.rng["python"])
    if d.device.type == "cuda" and "cuda" in ck.rng:
        torch.cuda.set_rng_state_all(ck.rng["cuda"])
    return TrainState(step=st["step"], best=st["best"], num_skipped=st.get("num_skipped_steps", 0))


def apply_optimizer_settings(run: Run) -> None:
    """After loading a checkpoint's optimizer and scheduler: this run's lr, betas and weight decay
    (the loaded state carries the checkpoint's; they differ only under force_resume). The schedule's
    shape comes from this run's config and total already (LambdaLR saves no function); its peak is
    set here. Where nothing changed, the scheduler's own formula gives the same values, bit for
    bit."""
    opt, sched = run.cfg.optimizer, run.sched
    sched.base_lrs = [opt.lr] * len(run.opt.param_groups)
    for group, lam in zip(run.opt.param_groups, sched.lr_lambdas, strict=True):
        group.update(initial_lr=opt.lr, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay)
        group["lr"] = opt.lr * lam(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in run.opt.param_groups]


def check_layout(run: Run, st: dict[str, Any], path: Path) -> None:
    """A checkpoint resumes at any world size and wrapping, but only with the rows per optimizer
    step it was written with: the step count, the lr schedule and the loader position all count
    steps of that size."""
    saved = st.get("global_batch_rows")
    if saved is None or saved == run.global_batch_rows:
        return
    cfg, world = run.cfg, run.d.world
    if saved % (cfg.loader.batch_size * world) == 0:
        fix = f"set loader.grad_accum: {saved // (cfg.loader.batch_size * world)}"
    else:
        fix = (
            "choose loader.batch_size and loader.grad_accum with batch_size x grad_accum x "
            f"{world} = {saved}"
        )
    raise ConfigError(
        f"{path / 'trainer_state.json'}: written with {saved} packed rows per optimizer step "
        f"(batch_size {st.get('batch_size')} x grad_accum {st.get('grad_accum')} x "
        f"{st.get('world_size')} process(es)); this run takes {run.global_batch_rows} (batch_size "
        f"{cfg.loader.batch_size} x grad_accum {cfg.loader.grad_accum} x {world}), which would "
        f"change the step count and the lr schedule: {fix}, or train into a new out dir"
    )


# ------------------------------------------------------------------------------------------ steps


def step_options(run: Run) -> dict[str, Any]:
    """ttt_forward's options: the loss group (train.loss) and the attention kernel."""
    loss = run.cfg.loss
    return dict(
        steps=loss.ttt_steps,
        loss_decay=loss.decay,
        attention=run.cfg.runtime.attention,
        temperature=loss.distill_temperature,
        feature_weight=loss.feature_weight,
        mid_feature_weight=loss.midlayer_feature_weight,
        copy_weight=loss.copy_weight,
        mid_target_block=run.aux_layer_ids.index(max(run.aux_layer_ids)),
        loss_weighting=loss.weighting,
    )


def validate(run: Run, batches) -> dict[str, float]:
    """Validation metrics; tau_estimate (replayed greedy rounds at k = num_speculative_tokens) picks
    best/."""
    cfg = run.cfg
    k = min(cfg.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS, cfg.loss.ttt_steps)
    m = score_batches(
        run.ttt,
        batches,
        run.head,
        steps=cfg.loss.ttt_steps,
        device=run.d.device,
        dtype=run.amp_dtype,
        replay_k=k,
        loss_decay=cfg.loss.decay,
        attention=cfg.runtime.attention,
    )
    m["loss"] = sum(cfg.loss.decay**j * m[f"loss_{j}"] for j in range(cfg.loss.ttt_steps))
    m["tau_per_row"] = tau_from_metrics(m, k)
    m["tau_estimate"] = m[
        "tau_replay"
    ]  # picks the best checkpoint: tracks vLLM's τ (docs/history/)
    return m


@dataclass
class BatchCheck:
    """Whether a step's batches hold NaN/inf hidden states: a device flag (checked with the step's
    one host sync) and, per micro-batch, the loader's sample indices, to name the bad samples only
    once the flag is set."""

    bad: torch.Tensor  # () bool on the device
    loader: Any
    rows: list[list[list[int]]]  # per micro-batch, the loader's last_rows

    def describe(self) -> list[str]:
        if not hasattr(self.loader, "name_nonfinite"):
            return ["samples not named (this loader keeps no sample indices)"]
        found = [self.loader.name_nonfinite(rows) for rows in self.rows]
        return [f for f in found if f] or [
            "no sample reads as NaN/inf on the host (values beyond the training dtype's range?)"
        ]


def forward_backward(
    run: Run, options: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, BatchCheck]:
    """grad_accum micro-batches forward and backward: (per-step stats, the step's loss, the NaN/inf
    batch check)."""
    cfg, d = run.cfg, run.d
    cuda = d.device.type == "cuda"
    step_stats = torch.zeros(cfg.loss.ttt_steps, len(STAT_COLUMNS), device=d.device)
    step_loss = torch.zeros((), device=d.device)
    check = BatchCheck(torch.zeros((), dtype=torch.bool, device=d.device), run.loader, [])
    for micro in range(cfg.loader.grad_accum):
        b = next(run.loader)
        check.rows.append(getattr(run.loader, "last_rows", []))
        b = b.to(d.device, run.amp_dtype if cuda else torch.float32)
        check.bad |= ~(
            torch.isfinite(b.aux).all() & torch.isfinite(b.last_hidden).all()
        )  # no host sync
        if cfg.loader.hidden_noise > 0:
            b.aux = add_hidden_noise(b.aux, len(run.aux_layer_ids), cfg.loader.hidden_noise)
        if (
            cfg.loss.supervise == "all"
        ):  # every token of every conversation, prompts too (validation: assistant only)
            b.loss_mask = b.doc_ids >= 0  # (B, T)
        sync = micro == cfg.loader.grad_accum - 1 or d.world == 1
        with parallel.gradient_sync(run.ttt, sync):  # one context around forward and backward
            with torch.autocast(
                d.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32
            ):
                loss, stats = run.ttt(b, run.head, **options)
            (loss / cfg.loader.grad_accum).backward()
        step_stats += stats
        step_loss += loss.detach() / cfg.loader.grad_accum
    return step_stats, step_loss, check


def skip_if_nonfinite(
    run: Run, state: TrainState, step_loss, gnorm, check: BatchCheck, log: MetricsLog
) -> bool:
    """True (gradients dropped, the step counted as skipped) when the loss, gradient or a batch on
    any rank is non-finite; NonFiniteError once more than max_nonfinite_steps were skipped."""
    cfg, d = run.cfg, run.d
    gfull = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    flags = torch.stack(
        [(~torch.isfinite(step_loss)).float(), check.bad.float(), (~torch.isfinite(gfull)).float()]
    )
    parallel.all_reduce_sum(flags, d)  # every rank skips the same steps
    if not bool(flags.sum() > 0):  # the one host sync per step
        return False
    problems = (
        check.describe() if bool(check.bad) else []
    )  # this rank's bad samples, read again to name them
    run.opt.zero_grad(set_to_none=True)
    state.num_skipped += 1
    what = (
        f"step {state.step + 1}: loss {step_loss.item():.4g}, gradient norm {float(gfull):.4g}; "
        + (
            f"the batch holds NaN/inf hidden states: {'; '.join(problems)}. The capture is "
            "corrupt: capture those samples again"
            if problems
            else "the batch is finite, so training diverged: lower optimizer.lr, raise "
            "schedule.warmup_steps or set optimizer.grad_clip"
        )
        + (" (a rank's batch held NaN/inf hidden states)" if not problems and flags[1] > 0 else "")
    )
    if state.num_skipped > cfg.optimizer.max_nonfinite_steps:
        raise NonFiniteError(
            f"non-finite training step ({state.num_skipped} so far, max_nonfinite_steps="
            f"{cfg.optimizer.max_nonfinite_steps}): {what}"
        )
    progress(
        d,
        f"skipped non-finite step ({state.num_skipped} of at most "
        f"{cfg.optimizer.max_nonfinite_steps}): {what}",
    )
    log.log(state.step, "skipped", {"num_skipped_steps": state.num_skipped})
    return True


def save(run: Run, state: TrainState, *, save_now: bool, best_now: bool) -> None:
    """Write checkpoints/step-N (save_now) and/or best/ (best_now); every rank joins the gathers."""
    d, step = run.d, state.step
    raw = parallel.full_state_dict(run.ttt, d) if run.ema is not None and save_now else None
    full = gather_weights(run)
    refuse_nonfinite(full, f"checkpoint step-{step}", step)
    optim = (
        parallel.full_optimizer_state(run.opt, d) if save_now else None
    )  # every rank: FSDP2 gathers
    meta = run.draft_metadata(step, state.val_metrics)
    if d.main and best_now:
        save_model_dir(run.out / "best", full, meta)
    if d.main and save_now:
        ckpt = save_checkpoint(
            run.out,
            full,
            optim,
            run.sched,
            step,
            run.loader,
            state.best,
            meta,
            raw=raw,
            num_skipped_steps=state.num_skipped,
            layout=run.layout(),
        )
        run.loader.on_checkpoint(ckpt)
        gone = prune_checkpoints(run.out, run.cfg.checkpoint.keep, step)
        if gone:
            progress(
                d,
                f"removed {', '.join(gone)} (checkpoint.keep={run.cfg.checkpoint.keep}: "
                "the newest ones and the best by validation stay)",
            )


def train_loop(run: Run, state: TrainState, log: MetricsLog, stop_after: int | None = None) -> None:
    """Optimizer steps until run.total (or stop_after steps in this call); validates every
    eval_every and saves every save_every steps, and at the end."""
    cfg, d = run.cfg, run.d
    options = step_options(run)
    window = _LogWindow(
        stats=torch.zeros(cfg.loss.ttt_steps, len(STAT_COLUMNS), device=d.device),
        loss=torch.zeros((), device=d.device),
        wait_mark=getattr(run.loader, "wait_s", 0.0),
        wall_mark=time.perf_counter(),
    )
    done_here = 0
    run.model.train()
    while state.step < run.total and (stop_after is None or done_here < stop_after):
        step_stats, step_loss, check = forward_backward(run, options)
        gnorm = torch.nn.utils.clip_grad_norm_(
            run.params, cfg.optimizer.grad_clip if cfg.optimizer.grad_clip > 0 else float("inf")
        )
        if skip_if_nonfinite(run, state, step_loss, gnorm, check, log):
            continue
        window.stats += step_stats
        window.loss += step_loss
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad(set_to_none=True)
        if run.ema is not None:
            run.ema.update(state.step)
        state.step, done_here, window.num_steps = (
            state.step + 1,
            done_here + 1,
            window.num_steps + 1,
        )
        step = state.step
        if step % cfg.checkpoint.log_every == 0 or step == run.total:
            _log_train(run, state, log, window, gnorm)
        best_now = False
        if run.val and (step % cfg.checkpoint.eval_every == 0 or step == run.total):
            best_now = _validate_step(run, state, log)
        save_now = (
            step % cfg.checkpoint.save_every == 0
            or step == run.total
            or (stop_after is not None and done_here == stop_after)
        )
        save_now = (
            run.loader.wants_checkpoint() or save_now
        )  # (every rank asks: a streaming loader syncs the answer)
        if d.world > 1:  # every rank joins the gather below; rank 0 decides
            flag = torch.tensor([float(best_now)], device=d.device)
            torch.distributed.broadcast(flag, 0)
            best_now = bool(flag.item())
        if save_now or best_now:
            save(run, state, save_now=save_now, best_now=best_now)
        parallel.barrier(d)


@dataclass
class _LogWindow:
    """The train steps since the last train log line, added up."""

    stats: torch.Tensor  # (K, len(STAT_COLUMNS)): the steps' summed statistics
    loss: torch.Tensor  # the steps' summed losses
    wait_mark: float  # the loader's wait and the wall clock at the last log line
    wall_mark: float
    num_steps: int = 0


def _log_train(
    run: Run, state: TrainState, log: MetricsLog, window: _LogWindow, gnorm: torch.Tensor
) -> None:
    """Log the train metrics of the window's steps (every rank's rows) and start a new window."""
    d, step = run.d, state.step
    parallel.all_reduce_sum(window.stats, d)
    parallel.all_reduce_sum(window.loss, d)  # the mean over every rank's rows, not rank 0's alone
    m = summarize(window.stats)
    state.last_loss = window.loss.item() / (window.num_steps * d.world)
    m.update(
        loss=state.last_loss,
        lr=run.sched.get_last_lr()[0],
        grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
        epoch=run.loader.epoch_progress(),
    )
    wait_now, wall_now = getattr(run.loader, "wait_s", 0.0), time.perf_counter()
    # the share of the wall time (validation and checkpoints included) spent waiting for a
    # packed batch
    m["loader_wait_frac"] = (wait_now - window.wait_mark) / max(wall_now - window.wall_mark, 1e-9)
    window.wait_mark, window.wall_mark = wait_now, wall_now
    log.log(step, "train", m)
    progress(
        d,
        f"step {step}/{run.total} loss {state.last_loss:.4f} acc_0 {m['acc_0']:.3f} epoch "
        f"{m['epoch']:.2f} {time.perf_counter() - run.t_start:.0f} s",
    )
    window.stats.zero_(), window.loss.zero_()
    window.num_steps = 0


def _validate_step(run: Run, state: TrainState, log: MetricsLog) -> bool:
    """Validate the model (its weight average where there is one) and log it; whether it is the
    best so far (a model with a non-finite validation loss never is)."""
    cfg, d, step = run.cfg, run.d, state.step
    best_now = False
    with averaged(run):
        state.val_metrics = validate(run, run.val)
        log.log(step, "val", state.val_metrics)
        if run.heldout:
            log.log(step, "heldout", validate(run, run.heldout))
    val_m = state.val_metrics
    progress(d, f"step {step} validation tau_estimate {val_m['tau_estimate']:.3f}")
    if not math.isfinite(val_m["loss"]):  # a NaN model scores τ 1.0: it must never become best/
        progress(
            d,
            f"step {step}: validation loss is {val_m['loss']}; this model cannot become best/",
        )
    elif val_m["tau_estimate"] > state.best:
        state.best, best_now = val_m["tau_estimate"], True
    if (
        step == cfg.checkpoint.eval_every
    ):  # train and eval graphs compiled by now: a run cut short still leaves them
        save_compile_cache(cfg.runtime.compile_cache, d)
    return best_now


def save_final(run: Run, state: TrainState) -> None:
    """final/ (the weight average when there is one), once the run reached its last step."""
    full = gather_weights(run)
    refuse_nonfinite(full, "final/", state.step)
    if run.d.main:
        save_model_dir(run.out / "final", full, run.draft_metadata(state.step, state.val_metrics))


__all__ = [
    "Run",
    "TrainState",
    "NonFiniteError",
    "build_optimizer",
    "resume",
    "train_loop",
    "save_final",
]
