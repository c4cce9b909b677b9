"""Checkpoints and draft dirs of a training run: what is written, how it is read back, and resume.

    checkpoints/step-N/   model.safetensors (draft minus the frozen embedding, fp32; the weight
                          average when ema_decay > 0, the raw weights then in raw.safetensors),
                          optimizer.pt (the full optimizer state as one process keys it, whatever
                          the world size, + scheduler; checkpoints of earlier FSDP runs: scheduler
                          only, plus optimizer/rank-R-of-W.pt shards), trainer_state.json (step,
                          loader epoch/cursor, best, world size and rows per step), rng.pt,
                          eagle3_draft.json (the run's settings and input identities: resume_inputs
                          compares them)
    best/, final/         model.safetensors + eagle3_draft.json (the draft's metadata,
                          `draft_metadata`)

Every file is written under a temp name and renamed (eagle3.io); a checkpoint that does not read
back whole is skipped for the one before it (read_latest_good_checkpoint). What a killed save leaves
(temp dirs) is deleted at the next start (remove_stale_files); train.checkpoint.keep bounds how
many step-N dirs stay (prune_checkpoints).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from eagle3.artifacts import CaptureManifest, DraftMetadata, SpoolHeader, list_checkpoints
from eagle3.config import ConfigError, TrainConfig
from eagle3.integrity import nonfinite_tensors
from eagle3.io import (
    CorruptFileError,
    atomic_dir,
    atomic_path,
    corrupt_file_errors,
    read_safetensors,
    tensor_nbytes,
    write_json,
)
from eagle3.model.draft import DraftConfig, text_config
from eagle3.model.family import DraftModel
from eagle3.train.metrics import progress

if TYPE_CHECKING:
    from eagle3.train.data import PackedLoader
    from eagle3.train.parallel import Dist

METADATA = DraftMetadata.FILE
WEIGHTS = "model.safetensors"
RAW_WEIGHTS = (
    "raw.safetensors"  # the raw training weights beside a weight-average model.safetensors
)


def draft_metadata(
    cfg: TrainConfig,
    dcfg: DraftConfig,
    manifest: CaptureManifest | SpoolHeader,
    target_cfg: dict,
    step: int,
    metrics=None,
    identity: dict | None = None,
    inputs: dict | None = None,
) -> DraftMetadata:
    """The draft's eagle3_draft.json. `identity` (eagle3.integrity.target_identity of the target
    trained with) is recorded so that export and evaluate can check they are given the same target;
    `inputs` (identities of the capture, vocab, validation capture and target:
    eagle3.train.resume_inputs) so that resume can check it continues the same run."""
    tc = text_config(target_cfg)
    return DraftMetadata(
        format=DraftMetadata.FORMAT,
        draft_config=dcfg.to_dict(),
        aux_layer_ids=list(cfg.aux_layer_ids or manifest.aux_layer_ids),
        captured_aux_layer_ids=list(manifest.aux_layer_ids),
        target=str(Path(cfg.target).resolve()),
        target_hidden_size=tc["hidden_size"],
        target_vocab_size=tc["vocab_size"],
        target_num_layers=tc.get("num_hidden_layers"),
        target_config_sha256=(identity or {}).get("config_sha256"),
        # every weight file's sha256
        target_fingerprint=(identity or {}).get("fingerprint"),
        target_max_position_embeddings=tc.get("max_position_embeddings"),
        chat_template_kwargs=getattr(manifest, "chat_template_kwargs", None),
        draft_vocab_size=dcfg.draft_vocab_size,
        vocab=str(cfg.vocab),
        captured=str(cfg.captured),
        step=step,
        ttt_steps=cfg.loss.ttt_steps,
        # every flag it was trained with (lr, supervise, init, ...)
        train_config=cfg.model_dump(mode="json"),
        inputs=dict(inputs or {}),
        metrics=metrics or {},
    )


def _draft_sd(model) -> dict[str, torch.Tensor]:
    """Draft weights (no frozen embedding) from a draft model or a full state dict of TTTModule
    (`draft.` prefix)."""
    sd = model if isinstance(model, dict) else model.state_dict()
    sd = {k.removeprefix("draft."): v for k, v in sd.items()}
    return {
        k: v.detach().cpu().contiguous() for k, v in sd.items() if not k.startswith("embed_tokens.")
    }


def _draft_nbytes(model) -> int:
    """Bytes _draft_sd(model) holds, without copying it."""
    sd = model if isinstance(model, dict) else model.state_dict()
    return tensor_nbytes({k: v for k, v in sd.items() if "embed_tokens." not in k})


def _save_weights(model, path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file(_draft_sd(model), str(tmp))


def save_checkpoint(
    out: Path,
    model,
    opt,
    sched,
    step: int,
    loader: PackedLoader,
    best: float,
    meta: DraftMetadata,
    raw=None,
    num_skipped_steps: int = 0,
    layout: dict | None = None,
) -> Path:
    """`model`: the draft model or a full state dict. `opt`: the optimizer, or its full state dict
    (eagle3.train.parallel.full_optimizer_state: what a sharded FSDP2 optimizer saves). `raw`: the
    raw weights when `model` is their moving average (resume reads both). `layout`: world size and
    rows per step, kept in trainer_state.json."""
    final = out / "checkpoints" / f"step-{step}"
    # what the directory will hold, named if the disk fills while it is written
    # (eagle3.errors.DiskFullError)
    optim = opt.state_dict() if isinstance(opt, torch.optim.Optimizer) else opt
    needed = _draft_nbytes(model) * (1 if raw is None else 2) + tensor_nbytes(optim)
    with atomic_dir(final, needed_bytes=needed) as tmp:
        _save_weights(model, tmp / WEIGHTS)
        if raw is not None:
            _save_weights(raw, tmp / RAW_WEIGHTS)
        torch.save({"optimizer": optim, "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        write_json(
            tmp / "trainer_state.json",
            {
                "step": step,
                **loader.state_dict(),
                "best": best,
                "num_skipped_steps": num_skipped_steps,
                **(layout or {}),
            },
        )
        meta.save(tmp)
    return final


def save_model_dir(path: Path, model: DraftModel, meta: DraftMetadata) -> Path:
    with atomic_dir(path, needed_bytes=_draft_nbytes(model)) as tmp:
        _save_weights(model, tmp / WEIGHTS)
        meta.save(tmp)
    return path


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects other than tensors and plain containers: it was not
    written by eagle3 (or was tampered with), and loading it could run code. Refused, never
    loaded."""


def load_torch_file(path: Path, map_location: Any = None) -> Any:
    """torch.load with weights_only=True (tensors, dicts, lists, tuples, numbers, strings only: no
    code runs from a checkpoint). A file that needs more is refused with UnsafeCheckpointError; a
    truncated or corrupt one is a CorruptFileError naming it."""
    try:
        with corrupt_file_errors(path, "checkpoint file"):
            return torch.load(path, map_location=map_location, weights_only=True)
    except CorruptFileError as e:
        if (
            isinstance(e.__cause__, pickle.UnpicklingError)
            and "weights only" in str(e.__cause__).lower()
        ):
            raise UnsafeCheckpointError(
                f"{path} holds pickled objects that are not plain tensors or containers; it was "
                "not written by eagle3 train (or was tampered with) and loading it could run code, "
                "so it is refused. Delete that checkpoint dir, or train with resume: false into a "
                "fresh out dir"
            ) from None
        raise


@dataclass
class CheckpointState:
    """Everything a resume reads from one checkpoint dir, read (and checked) before any of it is
    applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    raw: dict[str, torch.Tensor] | None
    # the full optimizer state, or this rank's shard (the per-rank FSDP layout of earlier versions)
    optimizer: Any
    scheduler: Any
    trainer_state: dict[str, Any]
    rng: dict[str, Any]
    meta: DraftMetadata | None  # its eagle3_draft.json: resume compares it with the new run's
    optimizer_is_shard: bool = False


def read_checkpoint(
    ckpt: Path, map_location: Any, optim_shard: str | None = None
) -> CheckpointState:
    """Read every file of `ckpt`; CorruptFileError when one is missing, truncated, corrupt or holds
    non-finite weights (the caller falls back to an older checkpoint), UnsafeCheckpointError for a
    planted pickle."""
    fix = "training falls back to the checkpoint before it"
    weights = read_safetensors(ckpt / WEIGHTS, "checkpoint weights", fix)
    raw = (
        read_safetensors(ckpt / RAW_WEIGHTS, "checkpoint weights", fix)
        if (ckpt / RAW_WEIGHTS).is_file()
        else None
    )
    for name, sd in ((WEIGHTS, weights), (RAW_WEIGHTS, raw or {})):
        bad = nonfinite_tensors(sd)
        if bad:
            raise CorruptFileError(f"{ckpt / name} holds non-finite weights ({', '.join(bad[:4])})")
    for name in ("optimizer.pt", "rng.pt", "trainer_state.json"):
        if not (ckpt / name).is_file():
            raise CorruptFileError(f"{ckpt / name} is missing: the checkpoint is incomplete")
    st = load_torch_file(ckpt / "optimizer.pt", map_location)
    is_shard = (
        "optimizer" not in st
    )  # earlier versions' FSDP checkpoints: one optimizer file per rank
    if is_shard:
        shard = ckpt / "optimizer" / (optim_shard or "")
        if optim_shard is None or not shard.is_file():
            have = sorted(p.name for p in (ckpt / "optimizer").glob("rank-*.pt"))
            raise ConfigError(
                f"{ckpt} holds its optimizer state in per-rank FSDP files "
                f"({', '.join(have[:2]) or 'none'}{', ...' if len(have) > 2 else ''}), the layout "
                "of earlier versions, which only the same world size under parallel fsdp2 can "
                "read: resume that way, or set resume: false"
            )
        optimizer = load_torch_file(shard, map_location)
    else:
        optimizer = st["optimizer"]
    with corrupt_file_errors(ckpt / "trainer_state.json", "checkpoint state"):
        state = json.loads((ckpt / "trainer_state.json").read_text())
    rng = load_torch_file(ckpt / "rng.pt")
    meta = None
    if (ckpt / METADATA).is_file():
        with corrupt_file_errors(ckpt / METADATA, "checkpoint metadata"):
            meta = DraftMetadata.load(ckpt)
    return CheckpointState(
        ckpt, weights, raw, optimizer, st["scheduler"], state, rng, meta, is_shard
    )


def read_latest_good_checkpoint(
    out: Path, map_location: Any, optim_shard: str | None, say
) -> CheckpointState | None:
    """The newest checkpoint of `out` that reads back whole; an unreadable one is reported (`say`)
    and the one before it tried. None when there is none; a ValueError when every one is
    unreadable."""
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
            f"no checkpoint in {out / 'checkpoints'} reads back whole ({len(found)} tried: "
            f"{'; '.join(errors[:3])}): delete the checkpoints dir to start over, or set resume: "
            "false with a new out dir"
        )
    return None


def remove_stale_files(out: Path) -> list[str]:
    """Delete what interrupted saves left in a training out dir (the caller holds its writer lock):
    the temp dirs of checkpoints, best/ and final/ (`.step-N.*.tmp`, checkpoints being pruned too),
    FSDP optimizer shards not yet moved into a checkpoint (`.optim-step-N`), and the `.NAME.old`
    copy a swap keeps for a moment, which is put back instead when NAME itself is gone. Returns the
    names removed (or restored)."""
    out = Path(out)
    ours = (".step-", ".best.", ".final.")
    done = []
    for root in (out / "checkpoints", out):
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            name = p.name
            stale = (
                name.startswith(ours)
                and name.endswith(".tmp")
                or (root.name == "checkpoints" and name.startswith(".optim-step-"))
            )
            if name.startswith(ours) and name.endswith(".old") and p.is_dir():
                final = p.with_name(name[1:].removesuffix(".old"))
                if not final.exists():
                    os.replace(p, final)
                    done.append(f"{name} (restored as {final.name})")
                    continue
                stale = True
            if stale:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                done.append(name)
    return done


def checkpoint_tau(ckpt: Path) -> float | None:
    """The validation tau estimate a checkpoint's eagle3_draft.json records (the last validation
    before it was saved), None when it has none or its validation loss is not finite (such a model
    never becomes best)."""
    try:
        m = DraftMetadata.load(ckpt).metrics or {}
    except (OSError, ValueError):
        return None
    tau, loss = m.get("tau_estimate"), m.get("loss")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (tau, loss)):
        return None
    return float(tau)


def prune_checkpoints(out: Path, keep: int, step: int) -> list[str]:
    """Keep the newest `keep` checkpoints of steps <= `step` plus the one with the best validation
    tau (the earliest of equals, as best/ is picked); delete the others (renamed to a `.tmp` name
    first, so that a kill midway leaves only what remove_stale_files deletes). Checkpoints past
    `step` (an earlier run this one did not resume) are left alone. keep=0 keeps all. Returns the
    names deleted."""
    if keep <= 0:
        return []
    ours = [p for p in list_checkpoints(out) if _step(p) <= step]  # newest first
    scored = [(tau, -_step(p), p) for p in ours if (tau := checkpoint_tau(p)) is not None]
    best = max(scored, key=lambda x: x[:2])[2] if scored else None
    gone = []
    for p in ours[keep:]:
        if p == best:
            continue
        doomed = p.with_name(f".{p.name}.prune.tmp")
        os.replace(p, doomed)
        shutil.rmtree(doomed)
        gone.append(p.name)
    return gone


def _step(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("step-"))


def check_draft_weights(model: DraftModel, sd: dict[str, torch.Tensor], path: Path) -> None:
    want = {k for k in model.state_dict() if not k.startswith("embed_tokens.")}
    if set(sd) != want:
        raise KeyError(
            f"{path}: missing {sorted(want - set(sd))}, unexpected {sorted(set(sd) - want)}"
        )


#: torch.compile's cache locations, pointed into a compile_cache directory while training runs
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def is_artifact_file(path: str | None) -> bool:
    """compile_cache names an existing FILE: the torch.compiler.save_cache_artifacts bundle of
    earlier versions."""
    return bool(path) and Path(path).is_file()


@contextlib.contextmanager
def compile_cache_dir(path: str | None, d: Dist):
    """While training: torch.compile's own caches (inductor graphs and autotuning, Triton kernels)
    live in `path`/inductor and `path`/triton, so whatever compiled here is found there by the next
    run, on this machine or on another one the directory is copied to (same GPU type and software).
    On two fresh H200s the first K7-T8192 step went from 51 s to 6 s this way; the artifact bundle
    (torch.compiler.save_cache_artifacts) missed every graph across machines in 2 of 2 tries
    (docs/history/2026-12.md). The variables are restored afterwards."""
    if not path or is_artifact_file(path):
        yield
        return
    root = Path(path)
    before = {k: os.environ.get(k) for k in COMPILE_CACHE_ENV}
    for k, sub in COMPILE_CACHE_ENV.items():
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.environ[k] = str((root / sub).resolve())
    files = [f for f in root.rglob("*") if f.is_file()]
    progress(
        d,
        f"compile cache: {root} ({len(files)} files, "
        f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB there already)",
    )
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_compile_cache(path: str | None, d: Dist) -> None:
    """An artifact FILE (is_artifact_file): seed torch.compile's caches from it
    (torch.compiler.load_cache_artifacts). A directory needs nothing here (compile_cache_dir)."""
    if is_artifact_file(path):
        try:
            info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
        except Exception as e:  # only a speed-up: train anyway, compiling from scratch, and say so
            progress(
                d,
                f"compile cache: {path} not loaded ({type(e).__name__}: {e}); compiling from "
                "scratch",
            )
            return
        if info is None:
            progress(
                d,
                f"compile cache: {path} not loaded (unreadable: corrupt, or written by another "
                "torch); compiling from scratch",
            )
            return
        progress(
            d,
            f"compile cache: {sum(len(v) for v in info.artifacts.values())} artifacts loaded from "
            f"{path}",
        )


def save_compile_cache(path: str | None, d: Dist) -> None:
    """An artifact FILE: rewrite it with every torch.compile artifact of this process (atomically;
    rank 0 only). A directory is written by torch itself as it compiles (compile_cache_dir)."""
    if not is_artifact_file(path) or not d.main:
        return
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(saved[0])
    progress(d, f"compile cache: {len(saved[0]) / 1e6:.1f} MB written to {path}")
