"""How the capture cuts rows into chunks (the backend's batches): from a chunk's first row, rows
while their tokens fit `chunk_tokens`, at least one row. A resumed capture and every engine of a
capture over several cut the rows as an uninterrupted one-engine capture does, so that their
states are bit-identical (eagle3.capture.run, eagle3.capture.engines)."""

from __future__ import annotations

from collections.abc import Sequence


def chunk_end(lengths: Sequence[int], rows: Sequence[int], a: int, chunk_tokens: int) -> int:
    """End (exclusive) of the chunk of `rows` that starts at position `a`; `lengths[row]`: the
    row's tokens."""
    b, tokens = a, 0
    while b < len(rows) and (b == a or tokens + lengths[rows[b]] <= chunk_tokens):
        tokens += int(lengths[rows[b]])
        b += 1
    return b
