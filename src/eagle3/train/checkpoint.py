"""Checkpoints and draft dirs of a training run: what is written, how it is read back, and resume.

    checkpoints/step-N/   model.safetensors (draft minus the frozen embedding, fp32; the weight average when
                          ema_decay > 0, the raw weights then in raw.safetensors), optimizer.pt (optimizer +
                          scheduler; under FSDP scheduler only, plus optimizer/rank-R-of-W.pt shards),
                          trainer_state.json (step, loader epoch/cursor, best), rng.pt, eagle3_draft.json
    best/, final/         model.safetensors + eagle3_draft.json (the draft's metadata, `draft_metadata`)

Every file is written under a temp name and renamed (eagle3.io); a checkpoint that does not read back whole is
skipped for the one before it (read_latest_good_checkpoint).
"""

from __future__ import annotations

import contextlib
import json
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
    write_json,
)
from eagle3.model.draft import DraftConfig, Eagle3Draft, text_config
from eagle3.train.metrics import progress

if TYPE_CHECKING:
    from eagle3.train.data import PackedLoader
    from eagle3.train.parallel import Dist

METADATA = DraftMetadata.FILE
WEIGHTS = "model.safetensors"
RAW_WEIGHTS = "raw.safetensors"  # the raw training weights beside a weight-average model.safetensors


def draft_metadata(cfg: TrainConfig, dcfg: DraftConfig, manifest: CaptureManifest | SpoolHeader,
                   target_cfg: dict, step: int, metrics=None,
                   identity: dict | None = None) -> DraftMetadata:
    """The draft's eagle3_draft.json. `identity` (eagle3.integrity.target_identity of the target trained with) is
    recorded so that export can check it is given the same target."""
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
        target_weights_sha256=(identity or {}).get("weights_sha256"),
        target_max_position_embeddings=tc.get("max_position_embeddings"),
        draft_vocab_size=dcfg.draft_vocab_size,
        vocab=str(cfg.vocab),
        captured=str(cfg.captured),
        step=step,
        ttt_steps=cfg.ttt_steps,
        # every flag it was trained with (lr, supervise, init, ...)
        train_config=cfg.model_dump(mode="json"),
        metrics=metrics or {},
    )


def _draft_sd(model) -> dict[str, torch.Tensor]:
    """Draft weights (no frozen embedding) from an Eagle3Draft or a full state dict of TTTModule (`draft.` prefix)."""
    sd = model if isinstance(model, dict) else model.state_dict()
    sd = {k.removeprefix("draft."): v for k, v in sd.items()}
    return {k: v.detach().cpu().contiguous() for k, v in sd.items() if not k.startswith("embed_tokens.")}


def _save_weights(model, path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file(_draft_sd(model), str(tmp))


def save_checkpoint(out: Path, model, opt, sched, step: int, loader: PackedLoader, best: float,
                    meta: DraftMetadata,
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
        meta.save(tmp)
    return final


def save_model_dir(path: Path, model: Eagle3Draft, meta: DraftMetadata) -> Path:
    with atomic_dir(path) as tmp:
        _save_weights(model, tmp / WEIGHTS)
        meta.save(tmp)
    return path


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


def check_draft_weights(model: Eagle3Draft, sd: dict[str, torch.Tensor], path: Path) -> None:
    want = {k for k in model.state_dict() if not k.startswith("embed_tokens.")}
    if set(sd) != want:
        raise KeyError(f"{path}: missing {sorted(want - set(sd))}, unexpected {sorted(set(sd) - want)}")



#: torch.compile's cache locations, pointed into a compile_cache directory while training runs
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def is_artifact_file(path: str | None) -> bool:
    """compile_cache names an existing FILE: the torch.compiler.save_cache_artifacts bundle of earlier versions."""
    return bool(path) and Path(path).is_file()


@contextlib.contextmanager
def compile_cache_dir(path: str | None, d: Dist):
    """While training: torch.compile's own caches (inductor graphs and autotuning, Triton kernels) live in
    `path`/inductor and `path`/triton, so whatever compiled here is found there by the next run, on this machine or
    on another one the directory is copied to (same GPU type and software). On two fresh H200s the first K7-T8192
    step went from 51 s to 6 s this way; the artifact bundle (torch.compiler.save_cache_artifacts) missed every graph
    across machines in 2 of 2 tries (docs/NOTES.md, session 10). The variables are restored afterwards."""
    if not path or is_artifact_file(path):
        yield
        return
    root = Path(path)
    before = {k: os.environ.get(k) for k in COMPILE_CACHE_ENV}
    for k, sub in COMPILE_CACHE_ENV.items():
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.environ[k] = str((root / sub).resolve())
    files = [f for f in root.rglob("*") if f.is_file()]
    progress(d, f"compile cache: {root} ({len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB "
                "there already)")
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_compile_cache(path: str | None, d: Dist) -> None:
    """An artifact FILE (is_artifact_file): seed torch.compile's caches from it (torch.compiler.load_cache_artifacts).
    A directory needs nothing here (compile_cache_dir)."""
    if is_artifact_file(path):
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


def save_compile_cache(path: str | None, d: Dist) -> None:
    """An artifact FILE: rewrite it with every torch.compile artifact of this process (atomically; rank 0 only). A
    directory is written by torch itself as it compiles (compile_cache_dir)."""
    if not is_artifact_file(path) or not d.main:
        return
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(saved[0])
    progress(d, f"compile cache: {len(saved[0]) / 1e6:.1f} MB written to {path}")

