"""The spool directory of streaming mode, as both sides use it: the producer (eagle3.capture.spool,
`eagle3 stream-capture`) and the consumer (eagle3.train.stream, `eagle3 stream-train`).

Spool layout (one directory; every file in it counts against the cap, temp files included)::

    stream.json     header (eagle3.artifacts.SpoolHeader), written once: config hash, aux_layer_ids,
                    hidden size, storage dtype, bytes/token, the validation rows, the training rows
                    and their token counts, epochs, seed
    ledger.json     the producer's commit record, rewritten atomically after each shard: where the
                    next sample is (phase, epoch, position in the epoch's order), the shards written
                    and not yet released (seq, file, sha256, bytes, epoch, samples), skip counts,
                    `blocked_bytes` (> 0 while waiting for room), `done`, `error`
    consumed.json   the consumer's record: shards with seq < `released_below` were consumed,
                    checkpointed and deleted; `done`, `error`
    val/shard-*.safetensors   validation shards, captured first and kept until training ends
    shard-*.safetensors       training shards, numbered (seq) across epochs; a capture dir's format
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import SpoolHeader
from eagle3.io import read_json

SPOOL_FORMAT = SpoolHeader.FORMAT
HEADER, LEDGER, CONSUMED = SpoolHeader.FILE, "ledger.json", "consumed.json"
VAL_DIR = "val"
#: room always left for rewriting the ledger files (plus twice their current size), in bytes
META_SLACK_BYTES = 16384


class PeerFailed(RuntimeError):
    """The other side recorded a failure in the spool (not recorded again: the cause is over
    there)."""


def spool_bytes(spool: Path) -> int:
    """Total size of every file under `spool` (temp files included)."""
    total = 0
    for root, _dirs, files in os.walk(spool):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # deleted by the other side meanwhile
                pass
    return total


def read_state(spool: Path, name: str) -> dict[str, Any]:
    """ledger.json / consumed.json, or {} when not written yet."""
    try:
        return read_json(spool / name)
    except FileNotFoundError:
        return {}


def meta_margin_bytes(spool: Path) -> int:
    """Room kept free for rewriting ledger.json and consumed.json (temp copy next to the old
    file)."""
    size = 0
    for name in (LEDGER, CONSUMED):
        try:
            size += (spool / name).stat().st_size
        except FileNotFoundError:
            pass
    return 2 * size + META_SLACK_BYTES


def epoch_order(train_rows: list[int], seed: int, epoch: int) -> list[int]:
    """The training rows in epoch `epoch`'s order (a seeded permutation, the same for both
    sides)."""
    rng = np.random.default_rng([seed, epoch])
    return [train_rows[i] for i in rng.permutation(len(train_rows))]
