"""Capture stage: aux-layer + last-layer hidden states of the target for every prepared token.

    run_capture(cfg: CaptureConfig) -> CaptureResult

What it writes is read by the other stages through the modules below the stages: the manifest through
eagle3.artifacts (CaptureManifest.load(dir), CaptureManifest.load_combined("dir[,dir...]")), the shards through
eagle3.shards (load_captured(dir): one sample at a time; iter_shards(dir): one shard's tensors at once). fp8 captures
(float8_e4m3fn + a float32 scale per token and layer, half the disk of bfloat16) come back dequantized to bfloat16.
Nothing here imports vLLM at import time: the hf backend runs on machines without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CaptureResult", "run_capture"]


def run_capture(cfg: Any, **kwargs: Any):
    from .run import run_capture as _run

    return _run(cfg, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "CaptureResult":
        from .run import CaptureResult

        return CaptureResult
    raise AttributeError(name)
