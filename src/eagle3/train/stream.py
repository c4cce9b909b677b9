"""Streaming (bounded-disk) mode, consumer side: train on a spool's shards as the producer writes
them.

`eagle3 stream-train` (run_stream_train) is `eagle3 train` with a SpoolSource instead of a capture
dir (spool layout: eagle3.spool_files). The loader reads the training shards in order (seq), packs
their samples into rows exactly as the offline loader does (greedy, rows never span epochs), and
records its position (shard seq, sample) in every checkpoint. A shard is deleted only after a
checkpoint's position is past it, so a kill at any point resumes from the latest checkpoint with
every sample still on disk.

Checkpoints: besides every `save_every` steps, the loader asks for one when it has consumed shards
that are not released yet and the producer is blocked on room or fewer shards are ready than one
optimizer step can span; only the newest of these extra checkpoints is kept. Validation uses the
spool's `val/` shards (captured once, kept until the end). `<out>/stream_samples.jsonl` lists, per
checkpoint, the rows (prepared-dataset indices) consumed since the previous one, per epoch: exactly
what the model trained on.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts import SpoolHeader
from eagle3.config import ConfigError, StreamTrainConfig
from eagle3.io import atomic_path, write_json
from eagle3.shards import load_shard, shard_samples
from eagle3.spool_files import (
    CONSUMED,
    HEADER,
    LEDGER,
    VAL_DIR,
    PeerFailed,
    epoch_order,
    meta_margin_bytes,
    read_state,
    spool_bytes,
)
from eagle3.train.data import collate, empty_row, pack
from eagle3.train.trainer import run_train

SAMPLES_LOG = "stream_samples.jsonl"


def count_packed_rows(lengths: list[int], T: int) -> int:
    """Rows the loader packs from samples of these token counts (0 = absent), greedily as
    data.PackedLoader."""
    rows, used, open_row = 0, 0, False
    for n in lengths:
        if n <= 0:
            continue
        if open_row and used + n > T:
            rows, used, open_row = rows + 1, 0, False
        used, open_row = used + n, True
        if used >= T:
            rows, used, open_row = rows + 1, 0, False
    return rows + int(open_row)


def _wait(spool: Path, cfg: StreamTrainConfig, what: str, ready) -> Any:
    """Poll until `ready()` returns something (not None); fail on a producer error or a stall."""
    last, since = None, time.time()
    while True:
        got = ready()
        if got is not None:
            return got
        led = read_state(spool, LEDGER)
        if led.get("error"):
            raise PeerFailed(f"stream-train: the producer (stream-capture) failed: {led['error']}")
        mark = (
            led.get("next_seq"),
            len(led.get("val_shards", [])),
            led.get("pos"),
            led.get("epoch"),
        )
        if mark != last:
            last, since = mark, time.time()
        if time.time() - since > cfg.stall_timeout_s:
            raise TimeoutError(
                f"stream-train: waited stream.stall_timeout_s = {cfg.stall_timeout_s} s for {what} "
                f"in {spool} and the producer made no progress: is `eagle3 stream-capture` running?"
            )
        time.sleep(cfg.poll_interval_s)


class SpoolSource:
    """What run_train needs from a spool: the manifest (header), validation samples, a loader, the
    row count."""

    def __init__(self, cfg: StreamTrainConfig):
        cfg.require("captured", "out")
        self.cfg, self.spool = cfg, Path(cfg.captured)
        if getattr(cfg, "aux_layer_ids", None):
            raise ConfigError(
                "train.aux_layer_ids is not supported in streaming mode: capture only the aux "
                "layers you train on (capture.aux_layer_ids)"
            )
        if cfg.loader.preload:
            raise ConfigError(
                "train.loader.preload = true is not supported in streaming mode (the spool is read "
                "shard by shard as it arrives); set train.loader.preload: false"
            )
        self.manifest: SpoolHeader = _wait(
            self.spool, cfg, HEADER, lambda: SpoolHeader.load(self.spool)
        )
        consumed = read_state(self.spool, CONSUMED)
        fresh = not any((Path(cfg.out) / "checkpoints").glob("step-*")) or not cfg.checkpoint.resume
        if fresh and (consumed.get("released_below", 0) > 0 or consumed.get("done")):
            raise ConfigError(
                f"{self.spool} was already consumed by a training run (its {CONSUMED} says so) but "
                f"train.out = {cfg.out} has no checkpoint to resume from: point train.out at that "
                "run, or delete the spool to start over"
            )
        write_json(self.spool / CONSUMED, {**consumed, "error": None})
        led = _wait(
            self.spool,
            cfg,
            "the validation shards",
            lambda: (lambda led: led if led.get("phase") == "train" else None)(
                read_state(self.spool, LEDGER)
            ),
        )
        self.val_samples = [
            s for e in led["val_shards"] for s in shard_samples(load_shard(self.spool / e["file"]))
        ]

    def num_rows(self, cfg: StreamTrainConfig) -> int:
        """Rows the whole stream packs into (every epoch): sets the length of the lr schedule."""
        h = self.manifest
        toks = h.row_tokens
        return sum(
            count_packed_rows(
                [toks[i] for i in epoch_order(h.train_rows, h.seed, e)], cfg.loader.max_seq_len
            )
            for e in range(h.epochs)
        )

    def loader(self, cfg: StreamTrainConfig, rank: int, world: int) -> StreamLoader:
        return StreamLoader(self, cfg, rank, world)


class StreamLoader:
    """Resumable iterator of PackedBatch over the spool's training shards, in seq order
    (rank-sharded by row)."""

    def __init__(self, source: SpoolSource, cfg: StreamTrainConfig, rank: int = 0, world: int = 1):
        self.source, self.cfg, self.spool = source, cfg, source.spool
        self.T, self.B, self.rank, self.world = (
            cfg.loader.max_seq_len,
            cfg.loader.batch_size,
            rank,
            world,
        )
        h = source.manifest
        self.n_aux, self.hidden = len(h.aux_layer_ids), h.hidden_size
        self.per_epoch = sum(1 for i in h.train_rows if h.row_tokens[i] > 0)
        self.seq, self.j = 0, 0  # next sample: shard seq, sample within it
        self.epoch, self.in_epoch = 0, 0  # epoch of the last sample taken, samples taken in it
        self.ended = False
        self.consumed: dict[
            str, list[int]
        ] = {}  # epoch -> prepared rows taken since the last checkpoint
        self._shard: tuple[int, int, list[dict[str, Any]]] | None = None  # (seq, epoch, samples)
        self._dtype: torch.dtype | None = None
        self.step_rows = cfg.loader.batch_size * cfg.loader.grad_accum * world
        self.max_ahead = self._check_cap()

    def _check_cap(self) -> int:
        """Shards one optimizer step can span; refuse a cap that cannot hold them next to the fixed
        files."""
        h, cfg = self.source.manifest, self.cfg
        longest = max(h.row_tokens or [1])
        span = math.ceil(self.step_rows * max(self.T, longest) / h.shard_tokens) + 2
        fixed = (self.spool / HEADER).stat().st_size + h.val_bytes_estimate
        need = fixed + (span + 1) * h.max_shard_bytes + meta_margin_bytes(self.spool)
        if need > cfg.spool_cap_bytes:
            raise ConfigError(
                f"stream.spool_cap_gb = {cfg.spool_cap_gb} cannot hold the shards one optimizer "
                f"step can span: {self.step_rows} rows (train.loader.batch_size x "
                f"train.loader.grad_accum x ranks) of train.loader.max_seq_len = {self.T} tokens "
                f"span up to {span} shards of up to "
                f"{h.max_shard_bytes} bytes (capture.shard_tokens = {h.shard_tokens}), plus "
                f"{fixed} bytes of header and validation shards: raise stream.spool_cap_gb "
                f"to at least {need / 1e9:.6g}, or lower capture.shard_tokens or the batch"
            )
        return span

    # ------------------------------------------------------------------------------- reading shards
    def _entry(self, seq: int) -> dict[str, Any] | None:
        """The ledger entry of shard `seq` once committed; {"end": True} after the stream's last
        shard."""
        led = read_state(self.spool, LEDGER)
        for e in led.get("shards", []):
            if e["seq"] == seq:
                return e
        if led.get("done") and seq >= led.get("next_seq", 0):
            return {"end": True}
        return None

    def _load(self) -> tuple[int, int, list[dict[str, Any]]] | None:
        if self._shard is not None and self._shard[0] == self.seq:
            return self._shard
        e = _wait(self.spool, self.cfg, f"shard {self.seq}", lambda: self._entry(self.seq))
        if e.get("end"):
            return None
        samples = list(shard_samples(load_shard(self.spool / e["file"])))
        self._shard = (self.seq, e["epoch"], samples)
        return self._shard

    def _peek(self) -> tuple[int, dict[str, Any]] | None:
        while not self.ended:
            sh = self._load()
            if sh is None:
                self.ended = True
                break
            if self.j < len(sh[2]):
                return sh[1], sh[2][self.j]
            self.seq, self.j = self.seq + 1, 0
        return None

    def _next_row(self) -> dict[str, torch.Tensor]:
        docs, used, row_epoch = [], 0, None
        while (nxt := self._peek()) is not None:
            epoch, s = nxt
            n = len(s["input_ids"])
            if docs and (epoch != row_epoch or used + n > self.T):
                break
            docs.append(s)
            used, row_epoch = used + n, epoch
            if epoch != self.epoch:
                self.epoch, self.in_epoch = epoch, 0
            self.in_epoch += 1
            self.consumed.setdefault(str(epoch), []).append(s["sample_index"])
            self.j += 1
            if used >= self.T:
                break
        if not docs:
            return empty_row(self.T, self.n_aux, self.hidden, self._dtype or torch.float32)
        self._dtype = docs[0]["aux_hidden_states"].dtype
        return pack(docs, self.T)

    def __iter__(self) -> StreamLoader:
        return self

    def __next__(self):
        rows = [
            self._next_row() for _ in range(self.B * self.world)
        ]  # every rank walks the same stream
        return collate(rows[self.rank :: self.world])

    def epoch_progress(self) -> float:
        return self.epoch + self.in_epoch / max(1, self.per_epoch)

    # ----------------------------------------------------------------------------- resume + release
    def _normalize(self) -> None:
        """Move past a fully consumed shard, so that a checkpoint covers (and may release) it."""
        if self._shard is not None and self._shard[0] == self.seq and self.j >= len(self._shard[2]):
            self.seq, self.j = self.seq + 1, 0

    def state_dict(self) -> dict[str, Any]:
        self._normalize()
        return {
            "epoch": self.epoch,
            "cursor": self.in_epoch,
            "stream_seq": self.seq,
            "stream_sample": self.j,
            "stream_consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seq, self.j = int(state["stream_seq"]), int(state["stream_sample"])
        self.epoch, self.in_epoch = int(state["epoch"]), int(state["cursor"])
        self.consumed = {}
        if self.rank == 0:
            self._log_consumed(int(state["step"]), state.get("stream_consumed", {}), resume=True)
            self._release()

    def wants_checkpoint(self) -> bool:
        """A checkpoint now lets consumed shards be deleted: asked for when the producer is blocked
        on room, or when the spool could not take the shards the next optimizer step may need."""
        self._normalize()
        want = False
        if self.rank == 0:
            released = int(read_state(self.spool, CONSUMED).get("released_below", 0))
            if self.seq > released:
                led = read_state(self.spool, LEDGER)
                ahead = sum(1 for e in led.get("shards", []) if e["seq"] > self.seq)
                room = (
                    self.cfg.spool_cap_bytes
                    - spool_bytes(self.spool)
                    - meta_margin_bytes(self.spool)
                )
                short = ahead < self.max_ahead and not led.get("done")
                need = (self.max_ahead - ahead) * self.source.manifest.max_shard_bytes
                want = led.get("blocked_bytes", 0) > 0 or (short and room < need)
        if self.world > 1:
            flag = torch.tensor([float(want)])
            torch.distributed.broadcast(flag, 0)
            want = bool(flag.item())
        return want

    def on_checkpoint(self, ckpt: Path) -> None:
        """After checkpoint `ckpt` (main rank): log what it covers, delete the shards before its
        position."""
        step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        self._log_consumed(step, self.consumed)
        self.consumed = {}
        self._release()
        _prune_checkpoints(ckpt.parent, keep=ckpt.name, save_every=self.cfg.checkpoint.save_every)

    def close(self, finished: bool) -> None:
        """End of this invocation; after the last step the spool's shards (validation too) are
        deleted."""
        if not finished or self.rank != 0:
            return
        c = read_state(self.spool, CONSUMED)
        write_json(self.spool / CONSUMED, {**c, "done": True})
        for f in [
            *self.spool.glob("shard-*.safetensors"),
            *(self.spool / VAL_DIR).glob("shard-*.safetensors"),
        ]:
            f.unlink(missing_ok=True)

    def _release(self) -> None:
        for f in self.spool.glob("shard-*.safetensors"):
            if int(f.name.removeprefix("shard-").removesuffix(".safetensors")) < self.seq:
                f.unlink(missing_ok=True)
        c = read_state(self.spool, CONSUMED)
        if c.get("released_below", 0) < self.seq:
            write_json(self.spool / CONSUMED, {**c, "released_below": self.seq})

    def _log_consumed(
        self, step: int, consumed: dict[str, list[int]], resume: bool = False
    ) -> None:
        """Append {step, rows per epoch} to the samples log. On resume, lines after `step` and a
        torn last line are dropped, and the resumed checkpoint's line is added if the kill came
        before it was written."""
        log = Path(self.cfg.out) / SAMPLES_LOG
        log.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, "rows": consumed}) + "\n"
        if not resume:
            with open(log, "a") as f:
                f.write(line)
            return
        keep = []
        for ln in log.read_text().splitlines() if log.is_file() else []:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if rec["step"] <= step:
                keep.append(json.dumps(rec) + "\n")
        if not any(json.loads(ln)["step"] == step for ln in keep):
            keep.append(line)
        with atomic_path(log) as tmp:
            tmp.write_text("".join(keep))


def _prune_checkpoints(ckpts: Path, keep: str, save_every: int) -> None:
    """Drop extra (stream-triggered) checkpoints older than `keep`; those at multiples of save_every
    stay."""
    keep_step = int(keep.removeprefix("step-"))
    for p in ckpts.glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and int(m.group(1)) < keep_step and int(m.group(1)) % save_every:
            shutil.rmtree(p, ignore_errors=True)


def read_samples_log(out: str | Path) -> dict[int, list[int]]:
    """epoch -> prepared rows trained on, from a streaming run's samples log (checkpointed
    consumption only)."""
    got: dict[int, list[int]] = {}
    for ln in (Path(out) / SAMPLES_LOG).read_text().splitlines():
        if ln.strip():
            for e, rows in json.loads(ln)["rows"].items():
                got.setdefault(int(e), []).extend(rows)
    return got


def run_stream_train(cfg: StreamTrainConfig, *, stop_after: int | None = None):
    """The consumer: `run_train` on the spool `cfg.captured` (waits for the producer's shards,
    deletes them once checkpointed). A failure is recorded in the spool so that the producer stops
    too."""
    try:
        return run_train(cfg, source=SpoolSource(cfg), stop_after=stop_after)
    except PeerFailed:
        raise
    except Exception as e:
        spool = Path(cfg.captured)
        if spool.is_dir():
            write_json(
                spool / CONSUMED,
                {**read_state(spool, CONSUMED), "error": f"{type(e).__name__}: {e}"},
            )
        raise
