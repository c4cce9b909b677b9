"""The third step of a capture: the prepared rows through the started backend, chunk by chunk,
one CapturedRow per row (its states, or why it was skipped).

How the rows are cut into chunks (the backend's batches): from a chunk's first row, rows while
their tokens fit `chunk_tokens`, at least one row. A resumed capture and every engine of a
capture over several cut the rows as an uninterrupted one-engine capture does, so that their
states are bit-identical (eagle3.capture.run, eagle3.capture.engines)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def chunk_end(lengths: Sequence[int], rows: Sequence[int], a: int, chunk_tokens: int) -> int:
    """End (exclusive) of the chunk of `rows` that starts at position `a`; `lengths[row]`: the
    row's tokens."""
    b, tokens = a, 0
    while b < len(rows) and (b == a or tokens + lengths[rows[b]] <= chunk_tokens):
        tokens += int(lengths[rows[b]])
        b += 1
    return b


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
