"""Capture stage: aux-layer + last-layer hidden states of the target for every prepared token.

    run_capture(cfg: CaptureConfig) -> CaptureResult

What it writes is read by the other stages through the modules below the stages: the manifest
through eagle3.artifacts (CaptureManifest.load(dir),
CaptureManifest.load_combined("dir[,dir...]")), the shards through eagle3.shards
(load_captured(dir): one sample at a time; iter_shards(dir): one shard's tensors at once). fp8
captures (float8_e4m3fn + a float32 scale per token and layer, half the disk of bfloat16) come
back dequantized to bfloat16. Nothing here imports vLLM at import time: the hf backend runs on
machines without vLLM."""

from __future__ import annotations

from .run import CaptureResult, run_capture

__all__ = ["CaptureResult", "run_capture"]
