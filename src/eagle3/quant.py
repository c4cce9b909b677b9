"""Storage encodings of captured states (torch only: imported by the vLLM worker and by the driver).

``to_storage`` turns a block of states in the compute dtype into what a shard stores, flagging rows
with NaN/inf. It runs where the states are produced (inside the vLLM worker, on the hf backend's
device) so that only storage-dtype bytes travel to the driver.

fp8 (``storage_dtype="fp8"``): float8_e4m3fn values with one float32 scale per row and layer
(per token, per captured layer): ``scale = absmax over H / 448``, ``value ~= fp8 * scale``.
An all-zero row has scale 0 (its fp8 values are 0). A non-finite row has a non-finite scale, which
is how non-finite samples are detected (the fp8 cast itself saturates inf to +-448).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
#: storage_dtype name -> dtype of the stored state tensors
STORAGE_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": FP8_DTYPE,
}
#: dtype the reader returns for fp8 shards (dequantized)
FP8_READ_DTYPE = torch.bfloat16


@dataclass
class Stored:
    """One sample's states in storage form."""

    states: torch.Tensor  # [T, A+1, H] storage dtype (aux in `aux_layer_ids` order, then last)
    scales: torch.Tensor | None  # [T, A+1] float32 (fp8 only)
    finite: bool  # False: some state of the sample was NaN/inf in the compute dtype (or overflowed)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q float8_e4m3fn [..., H], scale float32 [...]) with x ~= q * scale[...,
    None]."""
    x32 = x.float()  # [..., H]
    scale = (
        x32.abs().amax(-1) / FP8_MAX
    )  # [...]  (NaN/inf propagate: non-finite rows are detectable)
    inv = torch.where(
        scale > 0, 1.0 / scale, torch.zeros((), dtype=torch.float32, device=x.device)
    )  # [...]
    q = (x32 * inv.unsqueeze(-1)).to(FP8_DTYPE)  # [..., H]
    return q, scale


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = FP8_READ_DTYPE,
    block_rows: int = 16384,
) -> torch.Tensor:
    """q [N, ..., H] fp8, scale [N, ...] float32 -> [N, ..., H] `dtype` (float32 math, one
    rounding).

    Works in blocks of rows so the float32 temporaries stay small for large shards."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # [N, ..., H]
    for s in range(0, q.shape[0], block_rows):
        e = min(s + block_rows, q.shape[0])
        out[s:e] = q[s:e].float() * scale[s:e].unsqueeze(-1)
    return out


def to_storage(
    x: torch.Tensor, storage_dtype: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """States x [N, A+1, H] (compute dtype) -> (stored [N, A+1, H], scales [N, A+1] | None, row_ok
    [N] bool).

    row_ok is False for rows holding NaN/inf, including values the cast itself overflowed (fp16).
    Casts keep NaN/inf, so checking the stored values is enough for the float dtypes."""
    if storage_dtype == "fp8":
        q, scale = quantize_fp8(x)  # [N, A+1, H], [N, A+1]
        return q, scale, torch.isfinite(scale).all(-1)
    stored = x.to(STORAGE_TORCH_DTYPES[storage_dtype])  # [N, A+1, H]
    return stored, None, torch.isfinite(stored).flatten(1).all(1)


def stack_to_storage(
    layers: list[torch.Tensor], storage_dtype: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Like ``to_storage(torch.stack(layers, dim=-2), storage_dtype)`` for per-layer states [...,
    H], but for the float dtypes the stack and the cast are one pass (no compute-dtype copy of the
    stack)."""
    if storage_dtype == "fp8":
        x = torch.stack(layers, dim=-2)  # [..., A+1, H]
        q, scale = quantize_fp8(x)
        return q, scale, torch.isfinite(scale).all(-1)
    first = layers[0]
    stored = torch.empty(
        (*first.shape[:-1], len(layers), first.shape[-1]),
        dtype=STORAGE_TORCH_DTYPES[storage_dtype],
        device=first.device,
    )  # [..., A+1, H]
    for j, t in enumerate(layers):
        stored[..., j, :].copy_(t)
    return stored, None, torch.isfinite(stored).flatten(-2).all(-1)
