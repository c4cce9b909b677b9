"""The first step of a capture, shared by both modes (offline: eagle3.capture.run; streaming
spool: eagle3.capture.spool): the target (its layers, its config and weight fingerprints), the
aux layer ids, the prepared rows and their lengths, and the settings a resumed run must match
(`hashed`). What comes after reads these inputs, not the files again:

    inputs (here) -> backend (eagle3.capture.backend: the engine) -> chunks (eagle3.capture.chunks:
    rows through the engine) -> shards (eagle3.capture.writer) -> progress and manifest
    (eagle3.capture.run) or spool and ledger (eagle3.capture.spool)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import PreparedMeta, RecordedTarget, recorded_target_fingerprint
from eagle3.config import AuxLayerIds, CaptureConfig, ConfigError
from eagle3.identity import config_sha256, describe_difference, target_fingerprint
from eagle3.io import read_json, sha256_json
from eagle3.prepared import load_prepared
from eagle3.shards import storage_info
from eagle3.vllm_engine import resolve_dtype

from .hf_backend import resolve_device


@dataclass
class TargetInfo:
    num_hidden_layers: int
    hidden_size: int
    config_sha256: str
    max_position_embeddings: int | None


def target_info(target: str | Path) -> TargetInfo:
    """num_hidden_layers / hidden_size from config.json (nested `text_config` when present)."""
    p = Path(target) / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"CaptureConfig.target = {str(target)!r}: {p} does not exist; pass a local model "
            "directory"
        )
    cfg = read_json(p)
    text = cfg.get("text_config") or cfg
    try:
        return TargetInfo(
            int(text["num_hidden_layers"]),
            int(text["hidden_size"]),
            config_sha256(p),
            text.get("max_position_embeddings"),
        )
    except KeyError as e:
        raise ConfigError(
            f"{p} has no {e.args[0]!r} (nor in text_config): not a decoder-only LM config"
        ) from None


@dataclass
class CaptureInputs:
    """What both capture modes (offline, streaming spool) read first: the target, its layer ids, the
    prepared rows, and the settings a resumed run must match."""

    info: TargetInfo
    aux_layer_ids: list[int]
    ds: Any  # the prepared HF dataset
    prepared_manifest: PreparedMeta
    n_total: int  # rows to capture (cfg.limit applied)
    lengths: np.ndarray  # [n_total] tokens per row
    max_len: int
    max_model_len: int
    hashed: dict[str, Any]
    length_limit: int | None = (
        None  # rows of this many tokens or more are skipped as too long (capture_rows)
    )
    #: eagle3.identity.target_fingerprint of the target (every weight file); a resumed run matches
    target_fingerprint: dict[str, Any] | None = None


def load_capture_inputs(cfg: CaptureConfig) -> CaptureInputs:
    cfg.require("target", "data", "out")
    info = target_info(cfg.target)
    aux_layer_ids = AuxLayerIds.resolve(cfg.aux_layer_ids, info.num_hidden_layers).as_list()
    ds = load_prepared(cfg.data)
    prep_manifest = PreparedMeta.load(cfg.data)
    n_total = len(ds) if cfg.limit is None else min(cfg.limit, len(ds))
    lengths = _lengths(ds, n_total)  # [n_total]
    max_len = int(lengths.max()) if n_total else 1
    max_pos = info.max_position_embeddings
    # vLLM needs room for one generated token; by default never more than the target's positions
    # (vLLM refuses to start with a longer max_model_len): rows that do not fit are skipped and
    # counted as too_long
    max_model_len = cfg.max_model_len or (
        min(max_len + 1, int(max_pos)) if max_pos else max_len + 1
    )
    # the hf backend has no engine limit, but states past the target's positions are not what it was
    # trained for
    length_limit = (
        max_model_len if cfg.backend == "vllm" else (int(max_pos) + 1 if max_pos else None)
    )
    hashed = {
        "target": str(Path(cfg.target).resolve()),
        "target_config_sha256": info.config_sha256,
        "data": str(Path(cfg.data).resolve()),
        "prepared_manifest": sha256_json(prep_manifest.to_dict()),
        # hash input only; "layers" (its name before 2026-12-01) keeps the hash, so an interrupted
        # capture resumes
        "layers": aux_layer_ids,
        "dtype": cfg.dtype,
        "storage_dtype": cfg.storage_dtype,
        "shard_tokens": cfg.shard_tokens,
        "limit": cfg.limit,
        "backend": cfg.backend,
        "max_model_len": max_model_len,
    }
    # not in `hashed` (an interrupted capture of an earlier version still resumes): progress.json
    # and the manifest record it and a resumed run compares it (check_same_weights)
    fingerprint = target_fingerprint(cfg.target)
    return CaptureInputs(
        info,
        aux_layer_ids,
        ds,
        prep_manifest,
        n_total,
        lengths,
        max_len,
        max_model_len,
        hashed,
        length_limit,
        fingerprint,
    )


def check_same_weights(
    record: RecordedTarget, fingerprint: dict[str, Any] | None, path: Path, what: str
) -> None:
    """Refuse to add to (or to call complete) a capture whose record (progress.json, manifest.json,
    a spool header at `path`: its `recorded_target()`) was made from other target weights: its
    states would mix two models. A record from before 2026-12-03 has no fingerprint: warned once
    (eagle3.artifacts), not compared."""
    recorded = recorded_target_fingerprint(record, str(path))
    differs = describe_difference(recorded, fingerprint) if recorded and fingerprint else None
    if differs:
        raise ValueError(
            f"{path}: {what} other target weights ({differs}) than "
            f"target={record.target or '?'} holds now; its states would mix two models. "
            f"Delete {path.parent} (or use a new --out) to capture again with these weights, or "
            "put back the weights it was made from"
        )


def resolve_compute_dtype(cfg: CaptureConfig) -> CaptureConfig:
    """`dtype: auto` made concrete where the capture runs (float32 on a CPU without native bf16,
    where bf16 is emulated and measured 4-50x slower; bfloat16 elsewhere), before anything hashes or
    records it: a resumed capture, the manifest's compute_dtype and an explicit `dtype` all see the
    same name."""
    if cfg.dtype != "auto":
        return cfg

    device = None
    if cfg.backend == "hf":
        device = resolve_device(cfg.device)
    return cfg.model_copy(update={"dtype": resolve_dtype("auto", device=device)})


def open_capture(cfg: CaptureConfig) -> tuple[CaptureConfig, CaptureInputs]:
    """The first step of both capture modes (offline, streaming spool): the config with its dtype
    made concrete (resolve_compute_dtype), and the inputs it reads (load_capture_inputs)."""
    cfg = resolve_compute_dtype(cfg)
    return cfg, load_capture_inputs(cfg)


def recorded_capture(ci: CaptureInputs, bytes_per_token: int) -> dict:
    """What a capture's manifest and a streaming spool's header both record: the target it was
    made from (every weight file: train and export compare it), the layers, the storage."""
    return {
        "target": ci.hashed["target"],
        "target_config_sha256": ci.info.config_sha256,
        "data": ci.hashed["data"],
        "target_fingerprint": ci.target_fingerprint,
        "aux_layer_ids": ci.aux_layer_ids,
        "num_hidden_layers": ci.info.num_hidden_layers,
        "hidden_size": ci.info.hidden_size,
        "dtype": ci.hashed["storage_dtype"],
        "storage": storage_info(ci.hashed["storage_dtype"]),
        "compute_dtype": ci.hashed["dtype"],
        "backend": ci.hashed["backend"],
        "bytes_per_token": bytes_per_token,
    }


def _lengths(ds: Any, n: int) -> np.ndarray:
    """Token count of the first n prepared samples, from the Arrow offsets (no token is
    materialised)."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    import pyarrow.compute as pc  # heavy: only when there are rows to measure

    col = ds.with_format("arrow").select_columns(["input_ids"])[:n].column(0)  # list<int> [n]
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
