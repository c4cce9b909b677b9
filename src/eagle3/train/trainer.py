"""`run_train(cfg)`: read target/vocab/capture -> build draft -> TTT training loop -> checkpoints + metadata.

Layout under cfg.out:
    checkpoints/step-N/   model.safetensors (draft minus the frozen embedding, fp32; the weight average when
                          ema_decay > 0, the raw weights then in raw.safetensors), optimizer.pt (optimizer +
                          scheduler; under FSDP scheduler only, plus optimizer/rank-R-of-W.pt shards),
                          trainer_state.json (step, loader epoch/cursor, best), rng.pt, eagle3_draft.json
    best/                 model.safetensors + eagle3_draft.json of the best validation sim_accept_len
    final/                the same for the last step
    logs/metrics.jsonl    one record per log/eval event;  tb/  TensorBoard scalars;  curves.png

Loss normalisation: each micro-batch's loss is sum_j loss_decay**j * (mean soft-CE over its supervised,
in-draft-vocab rows of step j); micro-batches are averaged (/grad_accum) and DDP/FSDP average over ranks.
Resume restores weights, optimizer, scheduler, step, loader (epoch, cursor) and RNG, so N steps straight ==
N/2 + resume + N/2 bit-exactly on CPU fp32 (tests/test_train.py) and across FSDP ranks (checked with gloo).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.config import ConfigError, TrainConfig
from eagle3.integrity import check_target_identity, nonfinite_tensors, target_identity
from eagle3.io import (
    CorruptFileError,
    atomic_dir,
    atomic_path,
    corrupt_file_errors,
    read_safetensors,
    write_json,
)
from eagle3.lock import dir_lock
from eagle3.model.draft import DraftConfig, Eagle3Draft, draft_config_from_target, text_config
from eagle3.train import parallel
from eagle3.train.average import WeightAverage
from eagle3.train.data import (
    CapturedDataset,
    ConcatSamples,
    PackedLoader,
    SelectedLayers,
    eval_batches,
    load_samples,
    preload_samples,
    split_indices,
)
from eagle3.train.estimate import score_batches, tau_from_metrics
from eagle3.train.loss import TargetHead
from eagle3.train.step import STAT_COLUMNS, TTTModule, summarize
from eagle3.train.target import (
    init_layers_from_target,
    load_target_tensors,
    load_top_layers,
    load_vocab,
    read_target_config,
)

METADATA = "eagle3_draft.json"
WEIGHTS = "model.safetensors"
RAW_WEIGHTS = "raw.safetensors"  # the raw training weights beside a weight-average model.safetensors


@dataclass
class TrainResult:
    out: Path
    final_dir: Path
    best_dir: Path | None
    steps: int
    train_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * t)) if cfg.schedule == "cosine" else 1 - t
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f


def build_draft(cfg: TrainConfig, target_cfg: dict, tensors: dict, d2t, t2d, num_aux: int,
                aux_ids: list[int] | None = None) -> Eagle3Draft:
    """The draft for this target and vocab, initialised as cfg asks; aux_ids (fc's input order) is needed by
    init_layers_from_target."""
    tc = text_config(target_cfg)
    if t2d.numel() != tc["vocab_size"]:
        raise ConfigError(
            f"vocab={cfg.vocab}: t2d has {t2d.numel()} entries but the target's vocab_size is {tc['vocab_size']}; "
            "rebuild the vocab with this target's tokenizer"
        )
    dcfg = draft_config_from_target(target_cfg, num_aux, d2t.numel(), cfg.draft)
    dcfg.dropout = cfg.dropout
    model = Eagle3Draft(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed"].float())
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if cfg.init_head_from_target:  # logits = lm_head[draft rows] @ (norm_w * x / rms(x)), as the target's
            model.lm_head.weight.copy_(tensors["lm_head"][torch.arange(d2t.numel()) + d2t].float())
            model.norm.weight.copy_(tensors["norm"].float())
    if cfg.init_layers_from_target:
        init_layers_from_target(model, tensors["layers"], aux_ids)
    freeze_parameters(model, cfg.freeze)
    return model


def freeze_parameters(model: Eagle3Draft, prefixes: list[str]) -> None:
    """requires_grad=False for every draft parameter named by one of `prefixes` (`layers`, `layers.2`, `lm_head`)."""
    names = [n for n, _ in model.named_parameters() if not n.startswith("embed_tokens.")]
    for pre in prefixes:
        hit = [n for n in names if n == pre or n.startswith(pre + ".")]
        if not hit:
            tops = sorted({n.split(".")[0] for n in names} | {".".join(n.split(".")[:2]) for n in names if n.startswith("layers.")})
            raise ConfigError(f"freeze={prefixes}: {pre!r} names no parameter of this draft; use prefixes of {tops}")
        for n in hit:
            model.get_parameter(n).requires_grad_(False)
    if prefixes and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"freeze={prefixes} leaves nothing to train; freeze fewer parts")


def add_hidden_noise(aux: torch.Tensor, num_aux: int, scale: float) -> torch.Tensor:
    """aux (B, T, A*H) + N(0, (scale * rms)^2) per state, rms taken over each state's H features."""
    x = aux.unflatten(-1, (num_aux, -1))  # (B, T, A, H)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # (B, T, A, 1)
    return (x + (torch.randn_like(x, dtype=torch.float32) * rms * scale).to(x.dtype)).flatten(-2)  # (B, T, A*H)


def metadata(cfg: TrainConfig, dcfg: DraftConfig, manifest: dict, target_cfg: dict, step: int, metrics=None,
             identity: dict | None = None) -> dict:
    """The draft's eagle3_draft.json. `identity` (eagle3.integrity.target_identity of the target trained with) is
    recorded so that export can check it is given the same target."""
    tc = text_config(target_cfg)
    return {
        "format": "eagle3-draft/1",
        "draft_config": dcfg.to_dict(),
        "aux_layer_ids": list(cfg.layers or manifest["layers"]),
        "captured_layers": list(manifest["layers"]),
        "target": str(Path(cfg.target).resolve()),
        "target_hidden_size": tc["hidden_size"],
        "target_vocab_size": tc["vocab_size"],
        "target_num_layers": tc.get("num_hidden_layers"),
        "target_config_sha256": (identity or {}).get("config_sha256"),
        "target_weights_sha256": (identity or {}).get("weights_sha256"),
        "target_max_position_embeddings": tc.get("max_position_embeddings"),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "vocab": str(cfg.vocab),
        "captured": str(cfg.captured),
        "step": step,
        "ttt_steps": cfg.ttt_steps,
        "train_config": cfg.model_dump(mode="json"),  # every flag it was trained with (lr, supervise, init, ...)
        "metrics": metrics or {},
    }


def _draft_sd(model) -> dict[str, torch.Tensor]:
    """Draft weights (no frozen embedding) from an Eagle3Draft or a full state dict of TTTModule (`draft.` prefix)."""
    sd = model if isinstance(model, dict) else model.state_dict()
    sd = {k.removeprefix("draft."): v for k, v in sd.items()}
    return {k: v.detach().cpu().contiguous() for k, v in sd.items() if not k.startswith("embed_tokens.")}


def _save_weights(model, path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file(_draft_sd(model), str(tmp))


def save_checkpoint(out: Path, model, opt, sched, step: int, loader: PackedLoader, best: float, meta: dict,
                    optim_shards: Path | None = None, raw=None, num_skipped_steps: int = 0) -> Path:
    """`model`: Eagle3Draft or a full state dict. `optim_shards`: a dir of per-rank optimizer files (FSDP) that
    is moved into the checkpoint instead of saving `opt` (whose state is sharded). `raw`: the raw weights when
    `model` is their moving average (resume reads both)."""
    final = out / "checkpoints" / f"step-{step}"
    with atomic_dir(final) as tmp:
        _save_weights(model, tmp / WEIGHTS)
        if raw is not None:
            _save_weights(raw, tmp / RAW_WEIGHTS)
        if optim_shards is not None:
            shutil.move(str(optim_shards), tmp / "optimizer")
            torch.save({"scheduler": sched.state_dict()}, tmp / "optimizer.pt")
        else:
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        write_json(tmp / "trainer_state.json", {"step": step, **loader.state_dict(), "best": best,
                                                "num_skipped_steps": num_skipped_steps})
        write_json(tmp / METADATA, meta)
    return final


def save_model_dir(path: Path, model: Eagle3Draft, meta: dict) -> Path:
    with atomic_dir(path) as tmp:
        _save_weights(model, tmp / WEIGHTS)
        write_json(tmp / METADATA, meta)
    return path


def list_checkpoints(out: Path) -> list[Path]:
    """checkpoints/step-N dirs of a training out dir (those with a trainer_state.json), newest first."""
    steps = []
    for p in (Path(out) / "checkpoints").glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and (p / "trainer_state.json").is_file():
            steps.append((int(m.group(1)), p))
    return [p for _, p in sorted(steps, reverse=True)]


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[0] if found else None


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects other than tensors and plain containers: it was not written by
    eagle3 (or was tampered with), and loading it could run code. Refused, never loaded."""


def load_torch_file(path: Path, map_location: Any = None) -> Any:
    """torch.load with weights_only=True (tensors, dicts, lists, tuples, numbers, strings only: no code runs from
    a checkpoint). A file that needs more is refused with UnsafeCheckpointError; a truncated or corrupt one is a
    CorruptFileError naming it."""
    try:
        with corrupt_file_errors(path, "checkpoint file"):
            return torch.load(path, map_location=map_location, weights_only=True)
    except CorruptFileError as e:
        if isinstance(e.__cause__, pickle.UnpicklingError) and "weights only" in str(e.__cause__).lower():
            raise UnsafeCheckpointError(
                f"{path} holds pickled objects that are not plain tensors or containers; it was not written by eagle3 "
                "train (or was tampered with) and loading it could run code, so it is refused. Delete that checkpoint "
                "dir, or train with resume: false into a fresh out dir"
            ) from None
        raise


@dataclass
class CheckpointState:
    """Everything a resume reads from one checkpoint dir, read (and checked) before any of it is applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    raw: dict[str, torch.Tensor] | None
    optimizer: Any  # the full optimizer state, or this rank's shard (FSDP)
    scheduler: Any
    trainer_state: dict[str, Any]
    rng: dict[str, Any]


def read_checkpoint(ckpt: Path, map_location: Any, optim_shard: str | None = None) -> CheckpointState:
    """Read every file of `ckpt`; CorruptFileError when one is missing, truncated, corrupt or holds non-finite
    weights (the caller falls back to an older checkpoint), UnsafeCheckpointError for a planted pickle."""
    fix = "training falls back to the checkpoint before it"
    weights = read_safetensors(ckpt / WEIGHTS, "checkpoint weights", fix)
    raw = read_safetensors(ckpt / RAW_WEIGHTS, "checkpoint weights", fix) if (ckpt / RAW_WEIGHTS).is_file() else None
    for name, sd in ((WEIGHTS, weights), (RAW_WEIGHTS, raw or {})):
        bad = nonfinite_tensors(sd)
        if bad:
            raise CorruptFileError(f"{ckpt / name} holds non-finite weights ({', '.join(bad[:4])})")
    for name in ("optimizer.pt", "rng.pt", "trainer_state.json"):
        if not (ckpt / name).is_file():
            raise CorruptFileError(f"{ckpt / name} is missing: the checkpoint is incomplete")
    st = load_torch_file(ckpt / "optimizer.pt", map_location)
    if optim_shard is not None:
        shard = ckpt / "optimizer" / optim_shard
        if not shard.is_file():
            raise ConfigError(f"{ckpt} was saved by a different number of FSDP ranks (no {shard.name}); resume with "
                              "the same world size or set resume: false")
        optimizer = load_torch_file(shard, map_location)
    else:
        optimizer = st["optimizer"]
    with corrupt_file_errors(ckpt / "trainer_state.json", "checkpoint state"):
        state = json.loads((ckpt / "trainer_state.json").read_text())
    rng = load_torch_file(ckpt / "rng.pt")
    return CheckpointState(ckpt, weights, raw, optimizer, st["scheduler"], state, rng)


def read_latest_good_checkpoint(out: Path, map_location: Any, optim_shard: str | None, say) -> CheckpointState | None:
    """The newest checkpoint of `out` that reads back whole; an unreadable one is reported (`say`) and the one
    before it tried. None when there is none; a ValueError when every one is unreadable."""
    found = list_checkpoints(out)
    errors = []
    for ckpt in found:
        try:
            return read_checkpoint(ckpt, map_location, optim_shard)
        except CorruptFileError as e:
            errors.append(str(e))
            say(f"checkpoint {ckpt.name} is unreadable ({e}); trying the one before it")
    if found:
        raise CorruptFileError(
            f"no checkpoint in {out / 'checkpoints'} reads back whole ({len(found)} tried: {'; '.join(errors[:3])}): "
            "delete the checkpoints dir to start over, or set resume: false with a new out dir"
        )
    return None


def load_draft_weights(model: Eagle3Draft, path: Path) -> None:
    sd = read_safetensors(path, "draft weights")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise KeyError(f"{path}: missing {missing}, unexpected {unexpected}")


def check_draft_weights(model: Eagle3Draft, sd: dict[str, torch.Tensor], path: Path) -> None:
    want = {k for k in model.state_dict() if not k.startswith("embed_tokens.")}
    if set(sd) != want:
        raise KeyError(f"{path}: missing {sorted(want - set(sd))}, unexpected {sorted(set(sd) - want)}")


class Logger:
    def __init__(self, out: Path, enabled: bool):
        self.enabled, self.out = enabled, out
        self.tb = None
        if enabled:
            (out / "logs").mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except Exception:  # tensorboard missing: JSONL + PNG still written
                self.tb = None

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.out / "logs" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"{split}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.enabled:
            plot_curves(self.out / "logs" / "metrics.jsonl", self.out / "curves.png")


def plot_curves(jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not jsonl.is_file():
        return
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("val", "o-")):
        rs = [r for r in recs if r["split"] == split]
        if rs:
            a.plot([r["step"] for r in rs], [r["loss"] for r in rs], style, label=f"{split} loss")
    vr = [r for r in recs if r["split"] == "val"] or [r for r in recs if r["split"] == "train"]
    j = 0
    while vr and f"acc_{j}" in vr[0]:
        b.plot([r["step"] for r in vr], [r[f"acc_{j}"] for r in vr], label=f"acc step {j}")
        j += 1
    a.set_xlabel("step"), b.set_xlabel("step"), a.legend(), b.legend(fontsize=7)
    b.set_title(f"{vr[0]['split'] if vr else ''} top-1 agreement per TTT step")
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def progress(d, message: str) -> None:
    """One line on stderr from the main rank (training writes its metrics to logs/metrics.jsonl)."""
    if d.main:
        print(f"train: {message}", file=sys.stderr, flush=True)


def count_rows(samples, indices, T) -> int:
    rows, used = 0, T
    for i in indices:
        n = min(len(samples[i]["input_ids"]), T)
        if used + n > T:
            rows, used = rows + 1, 0
        used += n
    return rows


def run_train(
    cfg: TrainConfig, *, samples=None, manifest: dict | None = None, stop_after: int | None = None, source=None
) -> TrainResult:
    """Train the draft. `samples`/`manifest` replace reading cfg.captured (tests, in-memory data);
    `stop_after` ends this invocation after that many optimizer steps (the schedule still follows the full run);
    `source` (eagle3.train.stream.SpoolSource, streaming mode) gives the manifest, validation samples, loader
    and row count instead of a capture dir."""
    cfg.require("target", "captured", "vocab", "out")
    main = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 holds the out dir's writer lock
    with dir_lock(cfg.out, "train out") if main else nullcontext():
        return _run_train(cfg, samples=samples, manifest=manifest, stop_after=stop_after, source=source)


class NonFiniteError(ValueError):
    """Training met NaN/inf (in a batch's hidden states, the loss or the gradient) more often than
    max_nonfinite_steps allows."""


def _run_train(cfg: TrainConfig, *, samples, manifest, stop_after, source) -> TrainResult:
    d = parallel.setup(cfg.device)
    if d.device.type == "cuda":  # host work here is packing small tensors: a full OpenMP team per process
        torch.set_num_threads(min(torch.get_num_threads(), 4))  # oversubscribes the cores (each op ms, not µs)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    out = Path(cfg.out)

    manifest = source.manifest if source is not None else manifest
    if manifest is None:
        from eagle3.capture import load_combined_manifest

        manifest = load_combined_manifest(cfg.captured)
    target_cfg = read_target_config(cfg.target)
    tc = text_config(target_cfg)
    if manifest.get("hidden_size", tc["hidden_size"]) != tc["hidden_size"]:
        raise ConfigError(
            f"captured={cfg.captured}: manifest hidden_size={manifest['hidden_size']} but target={cfg.target} has "
            f"hidden_size={tc['hidden_size']}; capture again with this target"
        )
    tensors = load_target_tensors(cfg.target)
    identity = target_identity(cfg.target, tensors)
    check_target_identity(manifest, identity, what=f"captured={cfg.captured}", target=cfg.target,
                          allow=cfg.allow_target_mismatch, error=ConfigError)
    if cfg.init_layers_from_target:
        tensors["layers"] = load_top_layers(cfg.target, cfg.draft.num_hidden_layers or 1)
    d2t, t2d = load_vocab(cfg.vocab)
    layers = list(cfg.layers or manifest["layers"])
    model = build_draft(cfg, target_cfg, tensors, d2t, t2d, num_aux=len(layers), aux_ids=layers).to(d.device)
    dcfg = model.cfg
    cuda = d.device.type == "cuda"
    amp_dtype = torch.bfloat16 if cuda and cfg.dtype == "bfloat16" else torch.float32
    head = TargetHead(tensors["norm"], tc.get("rms_norm_eps", 1e-6), tensors["lm_head"],
                      torch.arange(d2t.numel()) + d2t).to(d.device, amp_dtype)

    L = tc["num_hidden_layers"]
    if cfg.midlayer_feature_loss_weight > 0 and max(layers) != L - dcfg.num_hidden_layers + 1:
        raise ConfigError(
            f"midlayer_feature_loss_weight: the deepest aux id {max(layers)} is not the state target layer "
            f"{L - dcfg.num_hidden_layers + 1} (the first one the draft copies) reads; with {L} target layers and "
            f"{dcfg.num_hidden_layers} draft layers use aux id {L - dcfg.num_hidden_layers + 1}, or change the draft's depth"
        )
    t_load = time.perf_counter()
    preload = cfg.preload and source is None and samples is None
    # one process per host hashes the capture (8 ranks reading a multi-TB capture 8 times would cost hours); if it
    # refuses the capture, torchrun stops the other ranks
    verify = cfg.verify_capture and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if source is not None:
        samples, how = source.val_samples, "spool validation"
    elif preload:  # sequential shard reads, only the trained layers kept in RAM
        samples, how = preload_samples(cfg.captured, layers, L, verify=verify), "in RAM"
    else:
        samples = load_samples(cfg.captured if samples is None else samples, verify=verify)
        how = "memory-mapped or given"
    if verify and source is None and isinstance(cfg.captured, str) and (preload or isinstance(
            samples, (CapturedDataset, ConcatSamples))):
        how += ", every shard sha256-verified"
    if cfg.layers is not None and not preload:
        samples = SelectedLayers(samples, manifest["layers"], layers, L)
    progress(d, f"{len(samples)} samples ({how}, layers {layers}) in {time.perf_counter() - t_load:.1f} s")
    aux_shape = tuple(samples[0]["aux_hidden_states"].shape[-2:]) if len(samples) else (dcfg.num_aux, dcfg.target_hidden_size)
    if aux_shape != (dcfg.num_aux, dcfg.target_hidden_size):
        raise ConfigError(
            f"captured={cfg.captured}: samples carry aux states of shape (T, {aux_shape[0]}, {aux_shape[1]}) but the "
            f"manifest lists {dcfg.num_aux} layers of hidden size {dcfg.target_hidden_size}; the capture is inconsistent"
        )
    if source is None:
        train_idx, val_idx = split_indices(len(samples), cfg.val_fraction, cfg.seed)
        loader = PackedLoader(samples, train_idx, cfg.max_seq_len, cfg.batch_size, cfg.seed, rank=d.rank, world=d.world,
                              prefetch=2)
    else:  # streaming: every spool sample here is validation; training rows come from the loader
        val_idx, loader = list(range(len(samples))), source.loader(cfg, d.rank, d.world)
    val = eval_batches(samples, val_idx, cfg.max_seq_len, cfg.batch_size)  # every rank (FSDP forward is collective)
    heldout = []
    if cfg.val_captured:  # unseen prompts pick the checkpoint; the held-out train split is still logged
        from eagle3.capture import capture_dirs, load_combined_manifest

        both = {str(p.resolve()) for p in capture_dirs(cfg.val_captured)} & (
            {str(p.resolve()) for p in capture_dirs(cfg.captured)} if source is None else set())
        if both:
            raise ConfigError(f"val_captured={cfg.val_captured} and captured={cfg.captured} share {sorted(both)}: "
                              "validation rows would be training rows; validate on a capture of other prompts")
        vm = load_combined_manifest(cfg.val_captured)
        check_target_identity(vm, identity, what=f"val_captured={cfg.val_captured}", target=cfg.target,
                              allow=cfg.allow_target_mismatch, error=ConfigError)
        vs = SelectedLayers(load_samples(cfg.val_captured, verify=verify), vm["layers"], layers, L)
        val, heldout = eval_batches(vs, list(range(len(vs))), cfg.max_seq_len, cfg.batch_size), val
    per_step = cfg.batch_size * cfg.grad_accum * d.world
    rows = source.num_rows(cfg) if source is not None else cfg.epochs * count_rows(samples, train_idx, cfg.max_seq_len)
    total = cfg.max_steps or max(1, math.ceil(rows / per_step))
    progress(d, f"{total} steps of {per_step} x {cfg.max_seq_len} tokens ({rows:.0f} packed rows), "
                f"{len(val)} validation batches")

    ttt = parallel.wrap(TTTModule(model), d, fsdp=cfg.parallel == "fsdp")
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel over all tensors on CUDA (the step's AdamW 8.4 ms vs its 2.8 ms byte floor in the H200
    # profile, docs/NOTES.md); FSDP2's sharded DTensor params keep the default (foreach) path
    fused = d.device.type == "cuda" and cfg.parallel != "fsdp"
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                            fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    ema = WeightAverage(params, cfg.ema_decay) if cfg.ema_decay > 0 else None

    def averaged():  # validate and save the weight average when there is one
        return ema.applied() if ema is not None else nullcontext()

    def gather_averaged() -> dict[str, torch.Tensor]:  # the full state to save: the average when there is one
        if ema is None:
            return parallel.full_state_dict(ttt, d)
        with ema.applied():  # copies: a state dict may share the parameters' storage, which the swap back rewrites
            return {k: v.detach().clone() for k, v in parallel.full_state_dict(ttt, d).items()}

    def load_weights(sd: dict[str, torch.Tensor], path: Path) -> None:
        check_draft_weights(model, sd, path)
        parallel.load_full_state_dict(ttt, {"draft." + k: v for k, v in sd.items()}, d)

    step, best, num_skipped = 0, -1.0, 0
    sharded_optim = cfg.parallel == "fsdp" and d.world > 1
    shard_name = f"rank-{d.rank}-of-{d.world}.pt" if sharded_optim else None
    ck = read_latest_good_checkpoint(out, d.device, shard_name, lambda m: progress(d, m)) if cfg.resume else None
    if d.world > 1:  # every rank resumes from the same step: the oldest any rank could read
        got = torch.tensor([ck.trainer_state["step"] if ck is not None else -1], device=d.device)
        torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MIN)
        if ck is not None and int(got.item()) != ck.trainer_state["step"]:
            ck = read_checkpoint(out / "checkpoints" / f"step-{int(got.item())}", d.device, shard_name) \
                if int(got.item()) >= 0 else None
    if ck is not None:
        ckpt = ck.path
        load_weights(ck.weights, ckpt / WEIGHTS)
        if ema is not None:  # model.safetensors holds the average (or, from a run without one, the weights)
            ema.reset()
            if ck.raw is not None:
                load_weights(ck.raw, ckpt / RAW_WEIGHTS)
        opt.load_state_dict(ck.optimizer)
        sched.load_state_dict(ck.scheduler)
        state = ck.trainer_state
        step, best, num_skipped = state["step"], state["best"], state.get("num_skipped_steps", 0)
        loader.load_state_dict(state)
        rng = ck.rng
        progress(d, f"resumed from {ckpt} (step {step})")
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if cuda and "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])

    log = Logger(out, d.main)
    load_compile_cache(cfg.compile_cache, d)
    kw = dict(steps=cfg.ttt_steps, loss_decay=cfg.loss_decay, attention=cfg.attention,
              temperature=cfg.distill_temperature, feature_weight=cfg.feature_loss_weight,
              mid_feature_weight=cfg.midlayer_feature_loss_weight, mid_target_block=layers.index(max(layers)))
    if cfg.compile:
        model.compile_blocks()

    def evaluate(batches) -> dict[str, float]:
        k = min(cfg.num_speculative_tokens, cfg.ttt_steps)
        m = score_batches(ttt, batches, head, steps=cfg.ttt_steps, device=d.device, dtype=amp_dtype, replay_k=k,
                          loss_decay=cfg.loss_decay, attention=cfg.attention)
        m["loss"] = sum(cfg.loss_decay**j * m[f"loss_{j}"] for j in range(cfg.ttt_steps))
        m["tau_per_row"] = tau_from_metrics(m, k)
        m["tau_estimate"] = m["tau_replay"]  # picks the best checkpoint: tracks vLLM's τ (docs/NOTES.md)
        return m

    def meta(metrics=None):
        return metadata(cfg, dcfg, manifest, target_cfg, step, metrics, identity)

    def refuse_nonfinite(sd: dict[str, torch.Tensor], where: str) -> None:
        bad = nonfinite_tensors(sd)
        if bad:
            raise NonFiniteError(f"step {step}: the draft weights to be saved as {where} hold NaN/inf ({', '.join(bad[:4])}); "
                                 "nothing was written. Training diverged: lower lr, raise warmup_steps or check the capture")

    train_stats = torch.zeros(cfg.ttt_steps, len(STAT_COLUMNS), device=d.device)
    loss_acc, n_acc, last_loss, val_m, done_here = torch.zeros((), device=d.device), 0, None, {}, 0
    model.train()
    while step < total and (stop_after is None or done_here < stop_after):
        step_stats, step_loss, problems = torch.zeros_like(train_stats), torch.zeros((), device=d.device), []
        for micro in range(cfg.grad_accum):
            b = next(loader)
            if getattr(loader, "last_nonfinite", None):  # NaN/inf in the batch's hidden states: which samples
                problems.append(loader.last_nonfinite)
            b = b.to(d.device, amp_dtype if cuda else torch.float32)
            if cfg.hidden_noise > 0:
                b.aux = add_hidden_noise(b.aux, len(layers), cfg.hidden_noise)
            if cfg.supervise == "all":  # every token of every conversation, prompts too (validation: assistant only)
                b.loss_mask = b.doc_ids >= 0  # (B, T)
            sync = micro == cfg.grad_accum - 1 or d.world == 1
            ctx = ttt.no_sync() if not sync and hasattr(ttt, "no_sync") else nullcontext()
            with ctx, torch.autocast(d.device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                loss, stats = ttt(b, head, **kw)
            with ctx:
                (loss / cfg.grad_accum).backward()
            step_stats += stats
            step_loss += loss.detach() / cfg.grad_accum
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        gfull = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
        flags = torch.stack([(~torch.isfinite(step_loss)).float(), torch.tensor(float(bool(problems)), device=d.device)])
        parallel.all_reduce_sum(flags, d)  # every rank skips the same steps
        if not bool(torch.isfinite(gfull)) or bool(flags.sum() > 0):  # one host sync per step
            opt.zero_grad(set_to_none=True)
            num_skipped += 1
            what = (f"step {step + 1}: loss {step_loss.item():.4g}, gradient norm {float(gfull):.4g}; "
                    + (f"the batch holds NaN/inf hidden states: {'; '.join(problems)}. The capture is corrupt: "
                       "capture those samples again" if problems else
                       "the batch is finite, so training diverged: lower lr, raise warmup_steps or set grad_clip")
                    + (" (a rank's batch held NaN/inf hidden states)" if not problems and flags[1] > 0 else ""))
            if num_skipped > cfg.max_nonfinite_steps:
                raise NonFiniteError(f"non-finite training step ({num_skipped} so far, max_nonfinite_steps="
                                     f"{cfg.max_nonfinite_steps}): {what}")
            progress(d, f"skipped non-finite step ({num_skipped} of at most {cfg.max_nonfinite_steps}): {what}")
            log.log(step, "skipped", {"num_skipped_steps": num_skipped})
            continue
        train_stats += step_stats
        loss_acc += step_loss
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(step)
        step, done_here, n_acc = step + 1, done_here + 1, n_acc + 1
        if step % cfg.log_every == 0 or step == total:
            parallel.all_reduce_sum(train_stats, d)
            m = summarize(train_stats)
            last_loss = loss_acc.item() / n_acc
            m.update(loss=last_loss, lr=sched.get_last_lr()[0], grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm), epoch=loader.epoch_progress())
            log.log(step, "train", m)
            progress(d, f"step {step}/{total} loss {last_loss:.4f} acc_0 {m['acc_0']:.3f} epoch {m['epoch']:.2f} "
                        f"{time.perf_counter() - t_load:.0f} s")
            train_stats.zero_(), loss_acc.zero_()
            n_acc = 0
        best_now = False
        if val and (step % cfg.eval_every == 0 or step == total):
            with averaged():
                val_m = evaluate(val)
                log.log(step, "val", val_m)
                if heldout:
                    log.log(step, "heldout", evaluate(heldout))
            progress(d, f"step {step} validation tau_estimate {val_m['tau_estimate']:.3f}")
            if not math.isfinite(val_m["loss"]):  # a NaN model scores τ 1.0: it must never become best/
                progress(d, f"step {step}: validation loss is {val_m['loss']}; this model cannot become best/")
            elif val_m["tau_estimate"] > best:
                best, best_now = val_m["tau_estimate"], True
            if step == cfg.eval_every:  # train and eval graphs compiled by now: a run cut short still leaves them
                save_compile_cache(cfg.compile_cache, d)
        save_now = step % cfg.save_every == 0 or step == total or (stop_after is not None and done_here == stop_after)
        save_now = loader.wants_checkpoint() or save_now  # (every rank asks: a streaming loader syncs the answer)
        if d.world > 1:  # every rank joins the gather below; rank 0 decides
            flag = torch.tensor([float(best_now)], device=d.device)
            torch.distributed.broadcast(flag, 0)
            best_now = bool(flag.item())
        if save_now or best_now:
            raw = parallel.full_state_dict(ttt, d) if ema is not None and save_now else None
            full = gather_averaged()
            refuse_nonfinite(full, f"checkpoint step-{step}")
            shards = None
            if sharded_optim and save_now:
                shards = out / "checkpoints" / f".optim-step-{step}"
                shards.mkdir(parents=True, exist_ok=True)
                torch.save(opt.state_dict(), shards / f"rank-{d.rank}-of-{d.world}.pt")
                parallel.barrier(d)
            if d.main and best_now:
                save_model_dir(out / "best", full, meta(val_m))
            if d.main and save_now:
                ckpt = save_checkpoint(out, full, opt, sched, step, loader, best, meta(val_m), optim_shards=shards,
                                       raw=raw, num_skipped_steps=num_skipped)
                loader.on_checkpoint(ckpt)
        parallel.barrier(d)

    final_dir = out / "final"
    if step >= total:
        full = gather_averaged()
        refuse_nonfinite(full, "final/")
        if d.main:
            save_model_dir(final_dir, full, meta(val_m))
    save_compile_cache(cfg.compile_cache, d)
    log.close()
    loader.close(finished=step >= total)
    parallel.teardown(d)
    best_dir = out / "best" if (out / "best").is_dir() else None
    return TrainResult(out, final_dir, best_dir, step, last_loss, val_m, meta(val_m))


def load_compile_cache(path: str | None, d: parallel.Dist) -> None:
    """Seed torch.compile's caches from `path` (written by save_compile_cache on the same GPU and software)."""
    if path and Path(path).is_file():
        try:
            info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
        except Exception as e:  # only a speed-up: train anyway, compiling from scratch, and say so
            progress(d, f"compile cache: {path} not loaded ({type(e).__name__}: {e}); compiling from scratch")
            return
        if info is None:
            progress(d, f"compile cache: {path} not loaded (unreadable: corrupt, or written by another torch); "
                        "compiling from scratch")
            return
        progress(d, f"compile cache: {sum(len(v) for v in info.artifacts.values())} artifacts loaded from {path}")


def save_compile_cache(path: str | None, d: parallel.Dist) -> None:
    """Write every torch.compile artifact of this process to `path` (atomically; rank 0 only)."""
    if not path or not d.main:
        return
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(saved[0])
    progress(d, f"compile cache: {len(saved[0]) / 1e6:.1f} MB written to {path}")


__all__ = ["run_train", "TrainResult", "save_checkpoint", "latest_checkpoint", "shutil"]
