"""`run_train(cfg)`: read target/vocab/capture -> build draft -> TTT training loop -> checkpoints +
metadata.

Layout under cfg.out (eagle3.train.checkpoint has the files of each dir):
    checkpoints/step-N/   weights, optimizer, scheduler, loader position, RNG, eagle3_draft.json
    best/                 model.safetensors + eagle3_draft.json of the best validation tau_estimate
    final/                the same for the last step
    logs/metrics.jsonl    one record per log/eval event;  tb/  TensorBoard scalars;  curves.png
                          (eagle3.train.metrics)

The entry reads as a sequence: setup -> inputs (capture manifest, target, vocab) -> draft -> data ->
optimizer -> resume -> loop (eagle3.train.loop) -> final/.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts import CaptureManifest, DraftMetadata, DraftVocab, SpoolHeader, capture_dirs
from eagle3.config import AuxLayerIds, ConfigError, TrainConfig
from eagle3.integrity import check_target_identity, target_identity, tensor_sha256
from eagle3.io import sha256_json, sha256_text
from eagle3.lock import dir_lock
from eagle3.model.draft import text_config
from eagle3.model.family import DraftModel, get_family
from eagle3.splits import split_indices
from eagle3.train import parallel
from eagle3.train.checkpoint import (
    compile_cache_dir,
    draft_metadata,
    load_compile_cache,
    remove_stale_files,
    save_compile_cache,
)
from eagle3.train.data import (
    CapturedDataset,
    ConcatSamples,
    PackedLoader,
    SelectedLayers,
    WithTargetArgmax,
    check_token_ids,
    compute_sample_argmax,
    eval_batches,
    load_samples,
    preload_samples,
)
from eagle3.train.loop import Run, TrainState, build_optimizer, resume, save_final, train_loop
from eagle3.train.loss import TargetHead
from eagle3.train.metrics import MetricsLog, progress
from eagle3.train.step import TTTModule
from eagle3.train.target import init_layers_from_target, load_top_layers
from eagle3.weights import load_target_tensors, read_target_config


@dataclass
class TrainResult:
    out: Path
    final_dir: Path
    best_dir: Path | None
    steps: int
    train_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def build_draft(
    cfg: TrainConfig,
    target_cfg: dict,
    tensors: dict,
    d2t,
    t2d,
    num_aux: int,
    aux_layer_ids: list[int] | None = None,
) -> DraftModel:
    """The draft of train.draft.family (eagle3.model.family) for this target and vocab,
    initialised as cfg asks; aux_layer_ids (fc's input order) is needed by
    init_layers_from_target."""
    tc = text_config(target_cfg)
    if t2d.numel() != tc["vocab_size"]:
        raise ConfigError(
            f"vocab={cfg.vocab}: t2d has {t2d.numel()} entries but the target's vocab_size is "
            f"{tc['vocab_size']}; rebuild the vocab with this target's tokenizer"
        )
    family = get_family(cfg.draft.family)
    dcfg = family.draft_config(target_cfg, num_aux, d2t.numel(), cfg.draft)
    dcfg.dropout = cfg.draft.dropout
    model = family.build(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed"].float())
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if (
            cfg.draft.init_head_from_target
        ):  # logits = lm_head[draft rows] @ (norm_w * x / rms(x)), as the target's
            model.lm_head.weight.copy_(tensors["lm_head"][torch.arange(d2t.numel()) + d2t].float())
            model.norm.weight.copy_(tensors["norm"].float())
    if cfg.draft.init_layers_from_target:
        init_layers_from_target(model, tensors["layers"], aux_layer_ids)
    freeze_parameters(model, cfg.draft.freeze)
    return model


def freeze_parameters(model: DraftModel, prefixes: list[str]) -> None:
    """requires_grad=False for every draft parameter named by one of `prefixes` (`layers`,
    `layers.2`, `lm_head`)."""
    names = [n for n, _ in model.named_parameters() if not n.startswith("embed_tokens.")]
    for pre in prefixes:
        hit = [n for n in names if n == pre or n.startswith(pre + ".")]
        if not hit:
            tops = sorted(
                {n.split(".")[0] for n in names}
                | {".".join(n.split(".")[:2]) for n in names if n.startswith("layers.")}
            )
            raise ConfigError(
                f"freeze={prefixes}: {pre!r} names no parameter of this draft; use prefixes of "
                f"{tops}"
            )
        for n in hit:
            model.get_parameter(n).requires_grad_(False)
    if prefixes and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"freeze={prefixes} leaves nothing to train; freeze fewer parts")


def count_rows(samples, indices, T) -> int:
    rows, used = 0, T
    for i in indices:
        n = min(len(samples[i]["input_ids"]), T)
        if used + n > T:
            rows, used = rows + 1, 0
        used += n
    return rows


@dataclass
class Inputs:
    """What training reads besides the samples: the capture's manifest, the target and the vocab."""

    manifest: CaptureManifest | SpoolHeader
    target_cfg: dict[str, Any]
    tensors: dict[str, Any]  # embed, norm, lm_head (+ layers when init_layers_from_target)
    identity: dict[str, Any]  # eagle3.integrity.target_identity of the target
    d2t: torch.Tensor
    t2d: torch.Tensor
    aux_layer_ids: list[int]  # the aux ids trained on, fc's input order
    ids: dict[str, Any] = field(default_factory=dict)  # a checkpoint records them (resume_inputs)

    @property
    def num_hidden_layers(self) -> int:
        return text_config(self.target_cfg)["num_hidden_layers"]


def run_train(
    cfg: TrainConfig,
    *,
    samples=None,
    manifest: CaptureManifest | dict | None = None,
    stop_after: int | None = None,
    source=None,
) -> TrainResult:
    """Train the draft. `samples`/`manifest` replace reading cfg.captured (tests, in-memory data);
    `stop_after` ends this invocation after that many optimizer steps (the schedule still follows
    the full run); `source` (eagle3.train.stream.SpoolSource, streaming mode) gives the manifest,
    validation samples, loader and row count instead of a capture dir."""
    cfg.require("target", "captured", "vocab", "out")
    main = (
        int(os.environ.get("RANK", "0")) == 0
    )  # under torchrun rank 0 holds the out dir's writer lock
    with dir_lock(cfg.out, "train out") if main else nullcontext():
        return _run_train(
            cfg, samples=samples, manifest=manifest, stop_after=stop_after, source=source
        )


def _run_train(cfg: TrainConfig, *, samples, manifest, stop_after, source) -> TrainResult:
    d = setup(cfg)
    with compile_cache_dir(cfg.runtime.compile_cache, d):
        return _train(
            cfg, d, samples=samples, manifest=manifest, stop_after=stop_after, source=source
        )


def _train(
    cfg: TrainConfig, d: parallel.Dist, *, samples, manifest, stop_after, source
) -> TrainResult:
    if d.main:  # this rank holds the out dir's writer lock: nothing else writes there now
        stale = remove_stale_files(Path(cfg.out))
        if stale:
            progress(
                d,
                f"removed {len(stale)} stale temporary checkpoint file(s) left by an "
                f"interrupted save in {cfg.out}: {', '.join(stale[:4])}"
                f"{' ...' if len(stale) > 4 else ''}",
            )
    inputs = read_inputs(cfg, manifest if source is None else source.manifest)
    model = build_draft(
        cfg,
        inputs.target_cfg,
        inputs.tensors,
        inputs.d2t,
        inputs.t2d,
        num_aux=len(inputs.aux_layer_ids),
        aux_layer_ids=inputs.aux_layer_ids,
    ).to(d.device)
    check_midlayer_target(cfg, model, inputs)
    run = build_run(cfg, d, inputs, model, samples, source)
    build_optimizer(run)
    state = resume(run) if cfg.checkpoint.resume else TrainState()
    log = MetricsLog(run.out, d.main)
    load_compile_cache(cfg.runtime.compile_cache, d)
    if cfg.runtime.compile:
        model.compile_blocks()
    try:
        train_loop(run, state, log, stop_after)
        if state.step >= run.total:
            save_final(run, state)
        save_compile_cache(cfg.runtime.compile_cache, d)
    finally:
        log.close()
        run.loader.close(finished=state.step >= run.total)
    parallel.teardown(d)
    out = run.out
    meta = run.draft_metadata(state.step, state.val_metrics)
    best_dir = out / "best" if (out / "best").is_dir() else None
    return TrainResult(
        out, out / "final", best_dir, state.step, state.last_loss, state.val_metrics, meta.to_dict()
    )


def setup(cfg: TrainConfig) -> parallel.Dist:
    """Device and process group; seeds."""
    d = parallel.setup(cfg.device)
    if (
        d.device.type == "cuda"
    ):  # host work here is packing small tensors: a full OpenMP team per process
        torch.set_num_threads(
            min(torch.get_num_threads(), 4)
        )  # oversubscribes the cores (each op ms, not µs)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    return d


def read_inputs(cfg: TrainConfig, manifest: CaptureManifest | SpoolHeader | dict | None) -> Inputs:
    """The capture's manifest (checked against the target), the target's frozen tensors and the
    vocab."""
    in_memory = manifest is not None and not (Path(str(cfg.captured)) / SpoolHeader.FILE).is_file()
    if manifest is None:
        manifest = CaptureManifest.load_combined(cfg.captured)
    elif isinstance(manifest, dict):  # given in memory (tests); it may use the old key names
        manifest = CaptureManifest.from_dict(manifest, "run_train(manifest=...)")
    target_cfg = read_target_config(cfg.target)
    tc = text_config(target_cfg)
    if manifest.hidden_size != tc["hidden_size"]:
        raise ConfigError(
            f"captured={cfg.captured}: manifest hidden_size={manifest.hidden_size} but "
            f"target={cfg.target} has "
            f"hidden_size={tc['hidden_size']}; capture again with this target"
        )
    tensors = load_target_tensors(cfg.target)
    # the old embedding/norm/lm_head fingerprint: for a capture from before 2026-12-03 only
    identity = check_target_identity(
        manifest.recorded_target(),
        f"captured={cfg.captured}",
        cfg.target,
        cfg.allow_target_mismatch,
        identity=target_identity(cfg.target, None if manifest.target_fingerprint else tensors),
    )
    if cfg.draft.init_layers_from_target:
        tensors["layers"] = load_top_layers(cfg.target, cfg.draft.num_hidden_layers or 1)
    d2t, t2d = DraftVocab.load(cfg.vocab).torch_maps()
    aux_layer_ids = list(cfg.aux_layer_ids or manifest.aux_layer_ids)
    field = (
        "TrainConfig.aux_layer_ids"
        if cfg.aux_layer_ids
        else f"captured={cfg.captured}: aux_layer_ids"
    )
    AuxLayerIds(tuple(aux_layer_ids)).check(tc["num_hidden_layers"], field, last_ok=True)
    ids = {
        "captured_sha256": capture_sha256(cfg.captured, manifest, given=in_memory),
        "vocab_sha256": sha256_text(tensor_sha256(d2t) + tensor_sha256(t2d)),
        "target_config_sha256": identity["config_sha256"],
        "target_config_file_sha256": identity["config_file_sha256"],  # what older records hold
        "target_weights_sha256": (identity["fingerprint"] or {}).get("sha256"),
        "val_captured_sha256": capture_sha256(cfg.val_captured, None) if cfg.val_captured else None,
    }
    return Inputs(manifest, target_cfg, tensors, identity, d2t, t2d, aux_layer_ids, ids)


def capture_sha256(
    captured: str | None, manifest: CaptureManifest | SpoolHeader | None, given: bool = False
) -> str:
    """The content identity of what is trained on: the sha256 of every capture dir's shard hashes
    (a shard's sha256 is in its manifest: nothing is read again), of a streaming spool's header
    hash, or of `manifest` itself when it was `given` in memory."""
    if given or not captured:
        return sha256_json(manifest.to_dict() if manifest is not None else None)
    dirs = capture_dirs(captured)
    if all((p / CaptureManifest.FILE).is_file() for p in dirs):
        return sha256_json([[s.sha256 for s in CaptureManifest.load(p).shards] for p in dirs])
    if manifest is None:
        return sha256_json({"spool": None, "target": None})
    return sha256_json({"spool": manifest.config_hash, "target": manifest.target})


def check_midlayer_target(cfg: TrainConfig, model: DraftModel, inputs: Inputs) -> None:
    L, n, ids = inputs.num_hidden_layers, model.cfg.num_hidden_layers, inputs.aux_layer_ids
    if cfg.loss.midlayer_feature_weight > 0 and max(ids) != L - n + 1:
        raise ConfigError(
            f"loss.midlayer_feature_weight: the deepest aux id {max(ids)} is not the state target "
            f"layer {L - n + 1} (the first one the draft copies) reads; with {L} target layers and "
            f"{n} draft layers use aux id {L - n + 1}, or change the draft's depth"
        )


def read_samples(cfg: TrainConfig, d: parallel.Dist, inputs: Inputs, samples, source):
    """The samples (all of them, or the spool's validation ones when streaming), holding the trained
    aux ids."""
    t_load = time.perf_counter()
    ids, L = inputs.aux_layer_ids, inputs.num_hidden_layers
    preload = cfg.loader.preload and source is None and samples is None
    # one process per host hashes the capture (8 ranks reading a multi-TB capture 8 times would cost
    # hours); if it refuses the capture, torchrun stops the other ranks
    verify = cfg.loader.verify_capture and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if source is not None:
        samples, how = source.val_samples, "spool validation"
    elif preload:  # sequential shard reads, only the trained layers kept in RAM
        samples, how = preload_samples(cfg.captured, ids, L, verify=verify), "in RAM"
    else:
        samples = load_samples(cfg.captured if samples is None else samples, verify=verify)
        how = "memory-mapped or given"
    if (
        verify
        and source is None
        and isinstance(cfg.captured, str)
        and (preload or isinstance(samples, (CapturedDataset, ConcatSamples)))
    ):
        how += ", every shard sha256-verified"
    check_token_ids(samples, int(inputs.tensors["embed"].shape[0]), cfg.captured, cfg.target)
    if cfg.aux_layer_ids is not None and not preload:
        samples = SelectedLayers(samples, inputs.manifest.aux_layer_ids, ids, L)
    progress(
        d,
        f"{len(samples)} samples ({how}, aux_layer_ids {ids}) in "
        f"{time.perf_counter() - t_load:.1f} s",
    )
    return samples, verify


def build_run(
    cfg: TrainConfig, d: parallel.Dist, inputs: Inputs, model: DraftModel, samples, source
) -> Run:
    """Samples, loader, validation batches and step count, around the (wrapped) draft and the
    target's head."""
    dcfg = model.cfg
    cuda = d.device.type == "cuda"
    amp_dtype = torch.bfloat16 if cuda and cfg.runtime.dtype == "bfloat16" else torch.float32
    head = _target_head(inputs, d, amp_dtype)
    t_start = time.perf_counter()
    samples, verify = read_samples(cfg, d, inputs, samples, source)
    _check_aux_shape(cfg, dcfg, samples)
    if source is None:
        samples = with_target_argmax(samples, head, d)
        train_idx, val_idx = split_indices(len(samples), cfg.loader.val_fraction, cfg.seed)
        loader = _packed_loader(cfg, d, samples, train_idx)
    else:  # streaming: every spool sample here is validation; training rows come from the loader
        train_idx, val_idx = [], list(range(len(samples)))
        loader = source.loader(cfg, d.rank, d.world)
    val = eval_batches(
        samples, val_idx, cfg.loader.max_seq_len, cfg.loader.batch_size
    )  # every rank (FSDP forward is collective)
    heldout = []
    if (
        cfg.val_captured
    ):  # unseen prompts pick the checkpoint; the held-out train split is still logged
        val, heldout = read_val_captured(cfg, inputs, source, verify, head, d), val
    total = _num_steps(cfg, d, samples, source, train_idx, len(val))
    mode = parallel.choose_parallel(cfg.runtime.parallel, model, d)
    if d.world > 1:
        progress(d, f"{d.world} processes: {mode} (train.runtime.parallel {cfg.runtime.parallel})")
    ttt = parallel.wrap(TTTModule(model), d, fsdp=mode == "fsdp2")

    return Run(
        cfg=cfg,
        d=d,
        out=Path(cfg.out),
        model=model,
        ttt=ttt,
        parallel=mode,
        head=head,
        loader=loader,
        val=val,
        heldout=heldout,
        total=total,
        amp_dtype=amp_dtype,
        aux_layer_ids=inputs.aux_layer_ids,
        draft_metadata=_metadata_of_step(cfg, dcfg, inputs),
        t_start=t_start,
    )


def _metadata_of_step(
    cfg: TrainConfig, dcfg: Any, inputs: Inputs
) -> Callable[[int, dict], DraftMetadata]:
    """The draft metadata a checkpoint of step `step` with `metrics` records."""

    def meta(step: int, metrics: dict) -> DraftMetadata:
        return draft_metadata(
            cfg,
            dcfg,
            inputs.manifest,
            inputs.target_cfg,
            step,
            metrics,
            inputs.identity,
            inputs.ids,
        )

    return meta


def _num_steps(
    cfg: TrainConfig,
    d: parallel.Dist,
    samples: Any,
    source: Any,
    train_idx: list[int],
    num_val_batches: int,
) -> int:
    """The run's optimizer steps: train.max_steps, else every epoch's packed rows (the stream's,
    when streaming) over the rows of one step."""
    per_step = cfg.loader.batch_size * cfg.loader.grad_accum * d.world
    rows = (
        source.num_rows(cfg)
        if source is not None
        else cfg.epochs * count_rows(samples, train_idx, cfg.loader.max_seq_len)
    )
    total = cfg.max_steps or max(1, math.ceil(rows / per_step))
    progress(
        d,
        f"{total} steps of {per_step} x {cfg.loader.max_seq_len} tokens ({rows:.0f} packed rows), "
        f"{num_val_batches} validation batches",
    )
    return total


def _target_head(inputs: Inputs, d: parallel.Dist, amp_dtype: torch.dtype) -> TargetHead:
    """The target's final norm and lm_head, over the draft vocabulary's target ids."""
    tc = text_config(inputs.target_cfg)
    return TargetHead(
        inputs.tensors["norm"],
        tc.get("rms_norm_eps", 1e-6),
        inputs.tensors["lm_head"],
        torch.arange(inputs.d2t.numel()) + inputs.d2t,
    ).to(d.device, amp_dtype)


def _check_aux_shape(cfg: TrainConfig, dcfg: Any, samples: Any) -> None:
    """ConfigError when the samples' aux states are not the (layers, hidden size) the capture's
    manifest lists."""
    aux_shape = (
        tuple(samples[0]["aux_hidden_states"].shape[-2:])
        if len(samples)
        else (dcfg.num_aux, dcfg.target_hidden_size)
    )
    if aux_shape != (dcfg.num_aux, dcfg.target_hidden_size):
        raise ConfigError(
            f"captured={cfg.captured}: samples carry aux states of shape (T, {aux_shape[0]}, "
            f"{aux_shape[1]}) but the manifest lists {dcfg.num_aux} layers of hidden size "
            f"{dcfg.target_hidden_size}; the capture is inconsistent"
        )


def _packed_loader(
    cfg: TrainConfig, d: parallel.Dist, samples: Any, train_idx: list[int]
) -> PackedLoader:
    """The training rows, packed, this rank's share."""
    return PackedLoader(
        samples,
        train_idx,
        cfg.loader.max_seq_len,
        cfg.loader.batch_size,
        cfg.seed,
        rank=d.rank,
        world=d.world,
        prefetch=2 * cfg.loader.num_workers,
        num_workers=cfg.loader.num_workers,
        pin_memory=d.device.type == "cuda",
    )


def with_target_argmax(samples, head: TargetHead, d: parallel.Dist) -> WithTargetArgmax:
    """The samples with the target's full-vocab argmax computed once
    (eagle3.train.data.compute_sample_argmax): each rank computes every world-th sample (each reads
    1/world of the last hidden states, not all of them), then every rank gets the whole table (the
    loader's packing hands any sample to any rank)."""
    t0 = time.perf_counter()
    mine = compute_sample_argmax(samples, head, d.device, range(d.rank, len(samples), d.world))
    idx = list(mine)
    lengths = [len(mine[i]) for i in idx]
    flat = (
        torch.cat([mine[i] for i in idx]).numpy() if idx else None
    )  # one array: pickles as raw bytes
    table: list[torch.Tensor | None] = [None] * len(samples)
    for r_idx, r_lengths, r_flat in parallel.all_gather_objects((idx, lengths, flat), d):
        parts = torch.from_numpy(r_flat).split(r_lengths) if r_idx else []
        for i, part in zip(r_idx, parts, strict=True):
            table[i] = part
    progress(
        d,
        f"target argmax of {len(samples)} samples ({len(idx)} on this rank) in "
        f"{time.perf_counter() - t0:.1f} s (once, not per epoch)",
    )
    return WithTargetArgmax(samples, table)


def read_val_captured(
    cfg: TrainConfig, inputs: Inputs, source, verify: bool, head: TargetHead, d: parallel.Dist
) -> list:
    """Validation batches from val_captured, a capture of other prompts than the training ones."""
    both = {str(p.resolve()) for p in capture_dirs(cfg.val_captured)} & (
        {str(p.resolve()) for p in capture_dirs(cfg.captured)} if source is None else set()
    )
    if both:
        raise ConfigError(
            f"val_captured={cfg.val_captured} and captured={cfg.captured} share {sorted(both)}: "
            "validation rows would be training rows; validate on a capture of other prompts"
        )
    vm = CaptureManifest.load_combined(cfg.val_captured)
    check_target_identity(
        vm.recorded_target(),
        f"val_captured={cfg.val_captured}",
        cfg.target,
        cfg.allow_target_mismatch,
        identity=inputs.identity,
    )
    vs = SelectedLayers(
        load_samples(cfg.val_captured, verify=verify),
        vm.aux_layer_ids,
        inputs.aux_layer_ids,
        inputs.num_hidden_layers,
    )
    vs = with_target_argmax(vs, head, d)
    return eval_batches(vs, list(range(len(vs))), cfg.loader.max_seq_len, cfg.loader.batch_size)


__all__ = ["run_train", "TrainResult", "build_draft"]
