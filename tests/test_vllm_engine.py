"""Engine settings helper and the spawned-subprocess runner (no engine started here)."""

from __future__ import annotations

import os

import pytest

from eagle3.vllm_engine import engine_kwargs, resolve_dtype, run_in_subprocess


def test_resolve_dtype_and_kwargs(tiny_llama):
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("auto") in ("float32", "bfloat16")
    kw = engine_kwargs(str(tiny_llama), dtype="float32", max_model_len=128, speculative_config={"method": "eagle3"})
    assert kw["model"] == kw["tokenizer"] == str(tiny_llama)
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 128 and kw["speculative_config"]["method"] == "eagle3"


def test_run_in_subprocess():
    assert run_in_subprocess(os.getpid) != os.getpid()
    with pytest.raises(RuntimeError, match="ValueError"):
        run_in_subprocess(int, "not a number")
