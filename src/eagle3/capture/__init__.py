"""Capture stage: aux-layer + last-layer hidden states of the target for every prepared token.

Public API (the manifest of a capture dir is eagle3.artifacts.CaptureManifest.load(dir), or
CaptureManifest.load_combined("dir[,dir...]") for several captures read as one dataset):
    run_capture(cfg: CaptureConfig) -> CaptureResult
    load_captured(dir) -> Iterator[dict]       # one sample: input_ids, loss_mask, aux_hidden_states,
                                               #   last_hidden_states, sample_id, sample_index
    iter_shards(dir) -> Iterator[dict]         # one shard's tensors at once (bulk reading)
States come back in the storage dtype of the capture (manifest `dtype`), except `storage_dtype: fp8`
(float8_e4m3fn + a float32 scale per token and layer, half the disk of bfloat16), which both readers
dequantize to bfloat16 transparently (`iter_shards(dir, dequantize=False)` gives the raw fp8 + scales).
Nothing here imports vLLM at import time: the hf backend runs on machines without vLLM.
"""

from __future__ import annotations

from typing import Any

from .storage import iter_shards, load_captured

__all__ = ["CaptureResult", "iter_shards", "load_captured", "run_capture"]


def run_capture(cfg: Any, **kwargs: Any):
    from .run import run_capture as _run

    return _run(cfg, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "CaptureResult":
        from .run import CaptureResult

        return CaptureResult
    raise AttributeError(name)
