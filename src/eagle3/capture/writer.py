"""Captured rows into shard files: what a one-engine capture (eagle3.capture.run) and each engine
of a capture over several (eagle3.capture.engine_main) do with the rows their backend yields."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.config import CaptureConfig
from eagle3.shards import TORCH_DTYPES, ShardBuffer, write_shard


class ShardWriter:
    """Adds captured rows to shard buffers and writes each buffer as a shard, handing the shard's
    entry to `on_written` once its file is complete.

    The driver writer holds the states in this process and writes a shard at once. The worker
    writer (cfg.writer "worker" with the vllm backend) leaves the states in the vLLM worker, which
    writes the shard (in the background where cfg.worker_background); the shard is handed on when
    the next one starts or at finish(), so that its write overlaps the capture of the next rows.
    At most one shard is in flight."""

    def __init__(
        self,
        cfg: CaptureConfig,
        backend: Any,
        out: Path,
        num_aux: int,
        hidden_size: int,
        on_written: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cfg, self.backend, self.out = cfg, backend, out
        self.num_aux, self.hidden_size = num_aux, hidden_size
        self.on_written = on_written
        self.worker = cfg.backend == "vllm" and cfg.writer == "worker"
        self.rids: list[str] = []  # worker writer: the worker-held states of the buffer, in order
        self.pending: int | None = None  # worker writer: the shard being written

    def add(self, buf: ShardBuffer, row: Any) -> int:
        """Add one CapturedRow (eagle3.capture.chunks) to `buf`: its skip, or its sample; the number
        of tokens it adds."""
        if row.skip:
            buf.skip(row.index, row.skip)
            return 0
        if self.worker:  # the driver keeps the bookkeeping; the states stay in the worker
            buf.add(row.index, row.sample_id, row.input_ids, row.loss_mask, None, None)
            self.rids.append(row.stored.rid)
        else:
            buf.add_stored(
                row.index, row.sample_id, row.input_ids, row.loss_mask, row.stored, self.num_aux
            )
        return int(row.input_ids.shape[0])

    def write(self, shard_id: int, buf: ShardBuffer) -> None:
        """Write `buf` (the rows added since the last write) as shard `shard_id`."""
        if not self.worker:
            dtype = TORCH_DTYPES[self.cfg.storage_dtype]
            self.on_written(
                write_shard(self.out, shard_id, buf, self.num_aux, self.hidden_size, dtype)
            )
            return
        self.finish()
        self.backend.start_write_shard(
            self.out,
            shard_id,
            buf,
            self.rids,
            self.num_aux,
            self.hidden_size,
            self.cfg.storage_dtype,
            self.cfg.worker_background,
        )
        self.rids, self.pending = [], shard_id

    def finish(self) -> None:
        """Wait for the shard in flight (worker writer) and hand it on."""
        if self.pending is not None:
            shard_id, self.pending = self.pending, None
            self.on_written(self.backend.wait_shard(shard_id))
