"""One capture over several engines (capture.num_engines): the shards are the bytes one engine
writes, one manifest, resume per engine after one is killed; the plan and the device split. hf
engines on the CPU (a process each); the two-vLLM-engine capture is marked slow (two engine
start-ups)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eagle3.artifacts import CaptureManifest
from eagle3.capture import run_capture
from eagle3.capture.engines import chunk_bounds, chunk_span, engine_environments, plan_shards
from eagle3.config import CaptureConfig, ConfigError
from test_capture import check_golden, make_prepared

NUM = 24


@pytest.fixture(scope="module")
def prepared(tiny_llama, tmp_path_factory):
    return make_prepared(tiny_llama, tmp_path_factory.mktemp("prep") / "engines", num=NUM, step=15)


def hf_cfg(target, data, out, **kw) -> CaptureConfig:
    # batch_tokens 120: several rows per hf batch, so a chunk's rows must be batched as one engine
    # batches them
    base = dict(
        target=str(target),
        data=str(data),
        out=out,
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        device="cpu",
        batch_tokens=120,
        shard_tokens=150,
    )
    return CaptureConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def one_engine(tiny_llama, prepared, tmp_path_factory):
    return run_capture(hf_cfg(tiny_llama, prepared, tmp_path_factory.mktemp("cap") / "one"))


def shard_hashes(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.glob("shard-*.safetensors"))
    }


def assert_same_capture(out: Path, ref: Path) -> None:
    got, want = CaptureManifest.load(out), CaptureManifest.load(ref)
    assert got.shards == want.shards  # files, sha256, rows, counts, skips
    assert (got.num_samples, got.num_tokens) == (want.num_samples, want.num_tokens)
    assert shard_hashes(out) == shard_hashes(ref)
    left = sorted(p.name for p in out.iterdir() if not p.name.startswith("shard-"))
    assert left == ["manifest.json", "progress.json"], left


def test_plan_cuts_where_one_engine_cuts():
    lengths = np.array([5, 0, 7, 20, 4, 4, 0, 9, 30, 0])  # 0: empty; >= 25: too long
    assert plan_shards(lengths, 10, 25) == [
        (0, 3),
        (3, 4),
        (4, 10),
    ]  # rows 8 (too long) and 9 (empty) fold into the last shard
    assert plan_shards(np.array([0, 40, 0]), 10, 25) == [
        (0, 3)
    ]  # every row skipped: one empty shard
    assert plan_shards(np.array([], dtype=np.int64), 10, 25) == []
    bounds = chunk_bounds(np.array([3, 3, 3, 9, 1, 1]), 6)
    assert bounds == [0, 2, 3, 4]
    assert chunk_span(bounds, 1, 3, 6) == (0, 3) and chunk_span(bounds, 4, 5, 6) == (4, 6)


def test_engine_devices():
    vllm = CaptureConfig(backend="vllm", tensor_parallel_size=2)
    assert [
        e["CUDA_VISIBLE_DEVICES"] for e in engine_environments(vllm, 2, ["4", "5", "6", "7"])
    ] == ["4,5", "6,7"]
    with pytest.raises(
        ConfigError,
        match=r"num_engines = 3 x tensor_parallel_size 2 needs 6 GPUs, but this process "
        r"sees 4 \(4,5,6,7\)",
    ):
        engine_environments(vllm, 3, ["4", "5", "6", "7"])
    hf = CaptureConfig(backend="hf")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in engine_environments(hf, 3, ["0", "1", "2"])] == [
        "0",
        "1",
        "2",
    ]
    with pytest.raises(ConfigError, match="names one device"):
        engine_environments(CaptureConfig(backend="hf", device="cuda:1"), 2, ["0", "1"])
    assert all(
        "CUDA_VISIBLE_DEVICES" not in e for e in engine_environments(hf, 2, [])
    )  # no GPU: CPU engines


def test_two_hf_engines_write_the_one_engine_shards(tiny_llama, prepared, one_engine, tmp_path):
    res = run_capture(hf_cfg(tiny_llama, prepared, tmp_path / "two", num_engines=2))
    assert_same_capture(res.out, one_engine.out)
    engines = res.extra["backend_info"]["engines"]
    assert [e["num_shards"] for e in engines] == [
        (one_engine.num_shards + 1) // 2,
        one_engine.num_shards // 2,
    ]
    assert sum(e["num_tokens"] for e in engines) == res.num_tokens == one_engine.num_tokens
    assert CaptureManifest.load(res.out).capture_config["num_engines"] == 2


RUN = (
    "import json, sys\nfrom eagle3.config import CaptureConfig\nfrom eagle3.capture import "
    "run_capture\n"
    "run_capture(CaptureConfig.model_validate(json.loads(sys.argv[1])))\n"
)


@pytest.mark.slow
def test_a_killed_engine_resumes_with_any_number_of_engines(tiny_llama, prepared, tmp_path):
    """Engine 1 is frozen (SIGSTOP) once it recorded a shard and SIGKILLed once engine 0 recorded
    one too: the driver stops engine 0 and fails naming engine 1; the rerun (3 engines) keeps every
    finished shard of both and captures the rest, byte for byte the one-engine capture."""
    one = run_capture(
        hf_cfg(tiny_llama, prepared, tmp_path / "one", shard_tokens=60)
    )  # a shard per row
    cfg = hf_cfg(tiny_llama, prepared, tmp_path / "killed", shard_tokens=60, num_engines=2)
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN, json.dumps(cfg.model_dump(mode="json"))],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    progress = [cfg.out / f"progress-engine-{e}.json" for e in (0, 1)]

    def record(e: int) -> dict:
        try:
            return json.loads(progress[e].read_text())
        except (OSError, ValueError):
            return {}

    victim, deadline = None, time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            if victim is None and record(1).get("shards"):
                victim = record(1)["pid"]
                os.kill(victim, signal.SIGSTOP)
            if victim is not None and record(0).get("shards"):
                os.kill(victim, signal.SIGKILL)
                break
            time.sleep(0.01)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert victim is not None, f"engine 1 recorded no shard: {err[-2000:]}"
    assert proc.returncode != 0 and "capture engine 1 of 2 (CPU) was killed by signal 9" in err, (
        err[-3000:]
    )
    assert not (cfg.out / "manifest.json").exists()
    done = {e["file"] for e in (*record(0)["shards"], *record(1)["shards"])}
    assert 2 <= len(done) < one.num_shards
    with pytest.raises(ProcessLookupError):
        os.kill(record(0)["pid"], 0)  # the driver stopped engine 0

    res = run_capture(cfg.model_copy(update={"num_engines": 3}))
    assert res.resumed_shards == len(done)
    assert_same_capture(res.out, one.out)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_vllm_engines(tiny_llama, tmp_path):
    """Two vLLM engines (CPU, one process each, engine in process): one manifest, shards from both,
    states equal to transformers' (the golden check of tests/test_capture.py) and byte for byte one
    vLLM engine's."""
    from test_capture import NUM_PROMPTS, capture_in_subprocess

    data = make_prepared(tiny_llama, tmp_path / "prep", num=NUM_PROMPTS)

    def cfg(out, n):
        return CaptureConfig(
            target=str(tiny_llama),
            data=str(data),
            out=out,
            backend="vllm",
            aux_layer_ids=[1, 2, 4],
            batch_tokens=64,
            shard_tokens=400,
            num_engines=n,
        )

    two = run_capture(cfg(tmp_path / "two", 2))
    engines = two.extra["backend_info"]["engines"]
    assert len(engines) == 2 and all(e["num_shards"] >= 1 for e in engines)
    check_golden(two.out, tiny_llama)
    one = capture_in_subprocess(cfg(tmp_path / "one", 1))
    assert_same_capture(two.out, one.out)
