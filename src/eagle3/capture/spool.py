"""Streaming (bounded-disk) mode, producer side: capture into a spool whose total size never exceeds
a cap.

`eagle3 stream-capture` (run_stream_capture) runs concurrently with `eagle3 stream-train`
(eagle3.train.stream), which trains on the shards as they arrive and deletes each one once a
checkpoint covers it. Every epoch is captured again (exact epochs, no replay buffer: docs/history/,
"Streaming").

Spool layout, the files both sides read and write: eagle3.spool_files.

Back-pressure: before a shard's temp file is created, the producer waits until
`spool bytes + shard bytes + metadata margin <= cap` (the margin covers the transient second copy of
the ledger files while they are rewritten). A shard becomes visible only by its atomic rename and
counts as written only once the ledger lists it, so a SIGKILL at any point loses at most the shard
being built: a restart deletes uncommitted files and continues from the ledger's position.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import SpoolHeader
from eagle3.config import ConfigError, StreamCaptureConfig
from eagle3.io import sha256_json, write_json
from eagle3.shards import (
    FORMAT,
    TORCH_DTYPES,
    ShardBuffer,
    bytes_per_token,
    write_shard,
)
from eagle3.splits import split_indices
from eagle3.spool_files import (
    CONSUMED,
    HEADER,
    LEDGER,
    META_SLACK_BYTES,
    SPOOL_FORMAT,
    VAL_DIR,
    PeerFailed,
    epoch_order,
    meta_margin_bytes,
    read_state,
    spool_bytes,
)

from .backend import open_backend
from .chunks import capture_rows
from .inputs import CaptureInputs, check_same_weights, open_capture, recorded_capture

#: per-shard allowance for the safetensors header (tensor table, sample ids), in bytes
SHARD_OVERHEAD_BYTES = 4096


class StopProducing(Exception):
    """The consumer is done (e.g. train.max_steps reached): nothing more is needed."""


def max_shard_bytes(
    shard_tokens: int, max_sample_tokens: int, bpt: int, min_sample_tokens: int
) -> int:
    """Largest shard the capture can write: a shard is cut once it holds >= shard_tokens tokens."""
    tokens = shard_tokens + max_sample_tokens - 1
    samples = tokens // max(1, min_sample_tokens) + 1
    return tokens * bpt + samples * 96 + SHARD_OVERHEAD_BYTES


@dataclass
class StreamCaptureResult:
    spool: Path
    epochs: int
    num_samples: int  # captured over all epochs (validation included once)
    num_tokens: int
    num_shards: int  # training shards written over the whole run
    num_val_shards: int
    resumed: bool
    stopped_early: bool  # the consumer finished first (train.max_steps)
    num_skipped: dict[str, int]
    cap_bytes: int
    peak_spool_bytes: int  # largest spool size this process admitted (data + margin)
    bytes_written: int
    wait_s: float  # time spent waiting for room (back-pressure)
    capture_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class _Producer:
    def __init__(
        self, cfg: StreamCaptureConfig, spool: Path, header: SpoolHeader, ledger: dict[str, Any]
    ):
        self.cfg, self.spool, self.header, self.ledger = cfg, spool, header, ledger
        self.cap = cfg.spool_cap_bytes
        self.peak = self.bytes_written = 0
        self.wait_s = 0.0

    def save_ledger(self) -> None:
        released = int(read_state(self.spool, CONSUMED).get("released_below", 0))
        self.ledger["shards"] = [e for e in self.ledger["shards"] if e["seq"] >= released]
        write_json(self.spool / LEDGER, self.ledger)

    def check_consumer(self) -> None:
        c = read_state(self.spool, CONSUMED)
        if c.get("error"):
            raise PeerFailed(f"stream-capture: the consumer (stream-train) failed: {c['error']}")
        if c.get("done"):
            raise StopProducing

    def wait_for_room(self, nbytes: int) -> None:
        """Back-pressure: return once the spool can take `nbytes` more without passing the cap."""
        t0 = last_change = time.time()
        last_used, announced = -1, False
        while True:
            self.check_consumer()
            used, margin = spool_bytes(self.spool), meta_margin_bytes(self.spool)
            if used + nbytes + margin <= self.cap:
                break
            fixed = used - sum(
                e["bytes"] for e in self.ledger["shards"] if (self.spool / e["file"]).exists()
            )
            if fixed + nbytes + margin > self.cap:
                raise ConfigError(
                    f"stream.spool_cap_gb = {self.cfg.spool_cap_gb} ({self.cap} bytes) cannot take "
                    f"a {nbytes}-byte shard next to the {fixed} bytes that stay in the spool "
                    "(header and validation shards): raise stream.spool_cap_gb, lower "
                    f"capture.shard_tokens ({self.cfg.shard_tokens}) or train.loader.val_fraction"
                )
            if used != last_used:
                last_used, last_change = used, time.time()
            if not announced:  # tell the consumer to checkpoint and release what it has consumed
                self.ledger["blocked_bytes"] = nbytes
                write_json(self.spool / LEDGER, self.ledger)
                announced = True
            if time.time() - last_change > self.cfg.stall_timeout_s:
                raise TimeoutError(
                    f"stream-capture: waited {time.time() - t0:.0f} s for room for {nbytes} bytes "
                    f"in {self.spool} (cap {self.cap} bytes, {used} used) and nothing was released "
                    f"for stream.stall_timeout_s = {self.cfg.stall_timeout_s}: is the consumer "
                    "(`eagle3 stream-train`) running?"
                )
            time.sleep(self.cfg.poll_interval_s)
        self.wait_s += time.time() - t0
        self.peak = max(self.peak, used + nbytes + margin)

    def commit(self, buf: ShardBuffer, phase: str, epoch: int, next_pos: int) -> None:
        """Write `buf` as the next shard (waiting for room), then record it in the ledger."""
        led = self.ledger
        skipped = led["skipped"]
        for r, c in buf.skipped.items():
            skipped[r] = skipped.get(r, 0) + c
        if buf.sample_ids:
            self.check_consumer()
            h = self.header
            if phase == "val":
                seq, out = len(led["val_shards"]), self.spool / VAL_DIR
            else:
                seq, out = led["next_seq"], self.spool
            out.mkdir(exist_ok=True)
            entry = write_shard(
                out,
                seq,
                buf,
                len(h.aux_layer_ids),
                h.hidden_size,
                TORCH_DTYPES[h.dtype],
                before_write=self.wait_for_room,
            )
            entry.update(seq=seq, epoch=epoch if phase == "train" else -1)
            if phase == "val":
                entry["file"] = f"{VAL_DIR}/{entry['file']}"
                led["val_shards"].append(entry)
            else:
                led["shards"].append(entry)
                led["next_seq"] = seq + 1
            led["num_samples"] += entry["num_samples"]
            led["num_tokens"] += entry["num_tokens"]
            self.bytes_written += entry["bytes"]
        led.update(phase=phase, epoch=epoch, pos=next_pos, blocked_bytes=0)
        self.save_ledger()

    def capture(
        self, phase: str, epoch: int, rows: list[int], start: int, capture_fn: Callable
    ) -> None:
        """Capture rows[start:] (positions in this phase's order), committing a shard every
        shard_tokens."""
        n_aux = len(self.header.aux_layer_ids)
        buf = ShardBuffer(first_index=start, next_index=start)
        pos = start
        for r in capture_fn(rows[start:]):
            pos = start + r.pos
            if r.skip:
                buf.skip(r.index, r.skip)
            else:
                buf.add_stored(r.index, r.sample_id, r.input_ids, r.loss_mask, r.stored, n_aux)
            buf.next_index = pos + 1  # position in the order (sample_index keeps the dataset row)
            if buf.num_tokens >= self.cfg.shard_tokens:
                self.commit(buf, phase, epoch, pos + 1)
                buf = ShardBuffer(first_index=pos + 1, next_index=pos + 1)
        self.commit(buf, phase, epoch, len(rows))


def run_stream_capture(cfg: StreamCaptureConfig) -> StreamCaptureResult:
    """The producer: capture the validation rows once, then every epoch's training rows in that
    epoch's seeded order, into the spool `cfg.out`, never letting it grow past `cfg.spool_cap_gb`.
    Resumes from the spool's ledger after a kill; returns early once the consumer says it is done. A
    failure is recorded in the spool's ledger, so that the consumer stops instead of waiting for
    shards."""
    try:
        return _produce(cfg)
    except PeerFailed:
        raise
    except Exception as e:
        if cfg.out is not None:
            spool = Path(cfg.out)
            spool.mkdir(parents=True, exist_ok=True)
            write_json(
                spool / LEDGER, {**read_state(spool, LEDGER), "error": f"{type(e).__name__}: {e}"}
            )
        raise


def _produce(cfg: StreamCaptureConfig) -> StreamCaptureResult:
    t0 = time.time()
    _refuse_unsupported(cfg)
    cfg, ci = open_capture(cfg)
    spool = Path(cfg.out)
    hashed = {**ci.hashed, "epochs": cfg.epochs, "val_fraction": cfg.val_fraction, "seed": cfg.seed}
    config_hash = sha256_json(hashed)
    spool.mkdir(parents=True, exist_ok=True)
    train_rows, val_rows = split_indices(ci.n_total, cfg.val_fraction, cfg.seed)
    header = _open_header(cfg, ci, spool, config_hash, train_rows, val_rows)
    ledger = read_state(spool, LEDGER)
    resumed = bool(ledger)
    if not ledger:
        ledger = _new_ledger(config_hash)
    _delete_uncommitted(spool, ledger)
    ledger.update(error=None, blocked_bytes=0)
    prod = _Producer(cfg, spool, header, ledger)
    t_cap = time.time()
    print(
        f"stream-capture: spool {spool} (cap {cfg.spool_cap_bytes} bytes), {len(val_rows)} "
        f"validation rows, {len(train_rows)} training rows x {cfg.epochs} epochs, "
        f"{header.bytes_per_token} bytes/token{' (resuming)' if resumed else ''}",
        file=sys.stderr,
        flush=True,
    )
    stopped = _capture_epochs(cfg, ci, prod, train_rows, val_rows)
    cap_s = time.time() - t_cap
    return StreamCaptureResult(
        spool=spool,
        epochs=cfg.epochs,
        num_samples=ledger["num_samples"],
        num_tokens=ledger["num_tokens"],
        num_shards=ledger["next_seq"],
        num_val_shards=len(ledger["val_shards"]),
        resumed=resumed,
        stopped_early=stopped,
        num_skipped=dict(ledger["skipped"]),
        cap_bytes=cfg.spool_cap_bytes,
        peak_spool_bytes=prod.peak,
        bytes_written=prod.bytes_written,
        wait_s=round(prod.wait_s, 3),
        capture_s=round(cap_s, 3),
        wall_s=round(time.time() - t0, 3),
    )


def _refuse_unsupported(cfg: StreamCaptureConfig) -> None:
    """ConfigError for the capture settings that streaming mode does not support yet."""
    if cfg.writer == "worker":
        raise ConfigError(
            "capture.writer = 'worker' is not supported in streaming mode yet (the spool writes "
            "each shard in the driver after waiting for room): set capture.writer: driver for "
            "stream-capture"
        )
    if cfg.num_engines > 1:
        raise ConfigError(
            f"capture.num_engines = {cfg.num_engines} is not supported in streaming mode yet (one "
            "producer fills the spool in order): set capture.num_engines: 1 for stream-capture"
        )


@dataclass
class _SpoolSizes:
    """What the spool must hold, from the rows' token counts."""

    bytes_per_token: int
    max_shard_bytes: int  # the largest shard the capture can write
    val_bytes: int  # the validation shards, estimated
    row_tokens: list[int]  # per prepared row, 0 for rows the capture skips (empty, too long)


def _spool_sizes(cfg: StreamCaptureConfig, ci: CaptureInputs, val_rows: list[int]) -> _SpoolSizes:
    """The sizes of `ci`'s rows in the spool."""
    lengths, limit_len = ci.lengths, ci.length_limit
    usable = (lengths > 0) & (
        lengths < limit_len if limit_len else True
    )  # rows that will be captured
    bpt = bytes_per_token(len(ci.aux_layer_ids), ci.info.hidden_size, cfg.storage_dtype)
    val_tokens = int(lengths[val_rows][usable[val_rows]].sum()) if val_rows else 0
    use_len = lengths[usable]
    shard_max = max_shard_bytes(
        cfg.shard_tokens, ci.max_len, bpt, int(use_len.min()) if len(use_len) else 1
    )
    val_bytes = (
        val_tokens * bpt + (math.ceil(val_tokens / cfg.shard_tokens) + 1) * SHARD_OVERHEAD_BYTES
        if val_rows
        else 0
    )
    return _SpoolSizes(bpt, shard_max, val_bytes, np.where(usable, lengths, 0).tolist())


def _open_header(
    cfg: StreamCaptureConfig,
    ci: CaptureInputs,
    spool: Path,
    config_hash: str,
    train_rows: list[int],
    val_rows: list[int],
) -> SpoolHeader:
    """The spool's header: the one a started run wrote (same settings and target weights, or an
    error), else a new one, written once the cap is known to hold it."""
    header = SpoolHeader.load(spool)
    if header is not None and header.config_hash != config_hash:
        raise ValueError(
            f"{spool / HEADER} belongs to a streaming run with other settings (config_hash "
            f"{header.config_hash} "
            f"!= {config_hash}): use a new stream.spool directory or delete {spool} (and the "
            "training run using it)"
        )
    if header:
        check_same_weights(
            header.recorded_target(),
            ci.target_fingerprint,
            spool / HEADER,
            "the streaming run was started with",
        )
    sizes = _spool_sizes(cfg, ci, val_rows)
    if header is None:
        header = SpoolHeader(
            **recorded_capture(ci, sizes.bytes_per_token),
            format=SPOOL_FORMAT,
            capture_format=FORMAT,
            config_hash=config_hash,
            stage="stream-capture",
            shard_tokens=cfg.shard_tokens,
            max_shard_bytes=sizes.max_shard_bytes,
            val_bytes_estimate=sizes.val_bytes,
            cap_bytes=cfg.spool_cap_bytes,
            epochs=cfg.epochs,
            seed=cfg.seed,
            num_input_samples=ci.n_total,
            val_rows=val_rows,
            train_rows=train_rows,
            row_tokens=sizes.row_tokens,
        )
    _check_cap(cfg, header, sizes)
    if not (spool / HEADER).is_file():
        header.save(spool)
    return header


def _check_cap(cfg: StreamCaptureConfig, header: SpoolHeader, sizes: _SpoolSizes) -> None:
    """ConfigError when the spool's cap cannot hold the header, the validation shards and two
    training shards."""
    # before it exists: a generous bound of its JSON
    header_bytes = len(str(header.to_dict())) * 2 + 4096
    val_bytes, shard_max = sizes.val_bytes, sizes.max_shard_bytes
    need = header_bytes + val_bytes + 2 * shard_max + 4 * META_SLACK_BYTES
    if need > cfg.spool_cap_bytes:
        raise ConfigError(
            f"stream.spool_cap_gb = {cfg.spool_cap_gb} ({cfg.spool_cap_bytes} bytes) is too small: "
            f"the spool must hold the validation shards (~{val_bytes} bytes at "
            f"train.loader.val_fraction = {cfg.val_fraction}) plus two shards of up to "
            f"{shard_max} bytes "
            f"(capture.shard_tokens = {cfg.shard_tokens} tokens + the longest sample, "
            f"{sizes.bytes_per_token} bytes/token) and the header: raise stream.spool_cap_gb to at "
            f"least {need / 1e9:.6g}, or lower capture.shard_tokens or train.loader.val_fraction"
        )


def _new_ledger(config_hash: str) -> dict[str, Any]:
    """The ledger of a spool nothing has been captured into yet."""
    return {
        "format": SPOOL_FORMAT,
        "config_hash": config_hash,
        "phase": "val",
        "epoch": 0,
        "pos": 0,
        "next_seq": 0,
        "val_shards": [],
        "shards": [],
        "skipped": {},
        "num_samples": 0,
        "num_tokens": 0,
        "blocked_bytes": 0,
        "done": False,
        "error": None,
    }


def _capture_epochs(
    cfg: StreamCaptureConfig,
    ci: CaptureInputs,
    prod: _Producer,
    train_rows: list[int],
    val_rows: list[int],
) -> bool:
    """Capture the validation rows, then every epoch's training rows, from where the ledger
    stands; the backend starts with the first row to capture. True when the consumer stopped
    it early."""
    ledger = prod.ledger
    backend = None
    chunk_tokens = cfg.batch_tokens  # the engine's own, once it has started

    def capture_fn(rows: list[int]) -> Any:
        nonlocal backend, chunk_tokens
        if backend is None:
            backend = open_backend(cfg, ci)
            chunk_tokens = int(backend.start().get("chunk_tokens", cfg.batch_tokens))
        return capture_rows(backend, ci.ds, ci.lengths, rows, chunk_tokens, ci.length_limit)

    try:
        if ledger["done"]:
            return False
        prod.save_ledger()
        if ledger["phase"] == "val":
            prod.capture("val", 0, val_rows, ledger["pos"], capture_fn)
            ledger.update(phase="train", epoch=0, pos=0)
            prod.save_ledger()
        for epoch in range(ledger["epoch"], cfg.epochs):
            start = ledger["pos"] if epoch == ledger["epoch"] else 0
            prod.capture(
                "train", epoch, epoch_order(train_rows, cfg.seed, epoch), start, capture_fn
            )
            print(
                f"stream-capture: epoch {epoch + 1}/{cfg.epochs} captured",
                file=sys.stderr,
                flush=True,
            )
            ledger.update(epoch=epoch + 1, pos=0)
            prod.save_ledger()
        ledger["done"] = True
        prod.save_ledger()
    except StopProducing:
        print("stream-capture: the consumer is done; stopping", file=sys.stderr, flush=True)
        return True
    finally:
        if backend is not None:
            backend.close()
    return False


def _delete_uncommitted(spool: Path, ledger: dict[str, Any]) -> None:
    """Remove what a killed producer left: shard temp files and shards written but not in the
    ledger."""
    listed = {e["file"] for e in ledger["val_shards"]} | {e["file"] for e in ledger["shards"]}
    for d, prefix in ((spool, ""), (spool / VAL_DIR, f"{VAL_DIR}/")):
        if not d.is_dir():
            continue
        for f in d.iterdir():
            name = f.name
            if name.startswith(".shard-") and name.endswith(".tmp"):
                f.unlink(missing_ok=True)
            elif name.startswith("shard-") and name.endswith(".safetensors"):
                seq = int(name.removeprefix("shard-").removesuffix(".safetensors"))
                uncommitted = (
                    seq >= ledger["next_seq"] if d == spool else prefix + name not in listed
                )
                if uncommitted:
                    f.unlink(missing_ok=True)
    for f in spool.glob(f".{LEDGER}.*.tmp"):
        f.unlink(missing_ok=True)
