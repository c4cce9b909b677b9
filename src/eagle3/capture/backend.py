"""The second step of a capture: the engine the rows go through, transformers or vLLM, for both
capture modes and every engine of a capture over several (eagle3.capture.engine_main)."""

from __future__ import annotations

from typing import Any

from eagle3.config import CaptureConfig

from .hf_backend import HFBackend
from .inputs import CaptureInputs
from .vllm_backend import VLLMBackend


def open_backend(cfg: CaptureConfig, ci: CaptureInputs, llm: Any = None) -> Any:
    """The backend (not started) that captures `ci`'s rows: transformers (`hf`) or a vLLM engine
    with the capture worker extension (`llm`: one already started, reused and not closed)."""
    aux_layer_ids, max_model_len = ci.aux_layer_ids, ci.max_model_len
    if cfg.backend == "hf":
        return HFBackend(
            str(cfg.target),
            aux_layer_ids,
            cfg.dtype,
            cfg.device,
            cfg.batch_tokens,
            cfg.storage_dtype,
            trust_remote_code=cfg.trust_remote_code,
        )

    return VLLMBackend(
        str(cfg.target),
        aux_layer_ids,
        cfg.dtype,
        cfg.batch_tokens,
        max_model_len,
        cfg.tensor_parallel_size,
        llm=llm,
        storage_dtype=cfg.storage_dtype,
        trust_remote_code=cfg.trust_remote_code,
    )
