"""A capture killed with SIGKILL mid-run resumes: completed shards are kept (sha256-verified), the
rest is captured, and the result equals an uninterrupted run (no lost or duplicated samples).

Uses the hf backend for the killed run: a vLLM engine start-up costs 30-90 s on the 2-core test box.
The resume logic (progress.json, shard hashes, next sample index) is backend-independent driver
code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eagle3.artifacts import CaptureManifest
from eagle3.capture import run_capture
from eagle3.config import CaptureConfig
from eagle3.shards import load_captured
from test_capture import make_prepared

NUM = 40


@pytest.fixture(scope="module")
def prepared_many(tiny_llama, tmp_path_factory):
    return make_prepared(tiny_llama, tmp_path_factory.mktemp("prep") / "many", num=NUM, step=15)


def _cfg(target, data, out):
    # batch_tokens < 2 x shortest sample: every hf batch is one sample, so the numerics do not
    # depend on where a run starts (bitwise comparison below)
    return CaptureConfig(
        target=str(target),
        data=str(data),
        out=out,
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        device="cpu",
        batch_tokens=30,
        shard_tokens=150,
    )


def kill_capture_after_first_shard(cfg: CaptureConfig) -> list[dict]:
    """Run `run_capture(cfg)` in a subprocess, SIGKILL it once a shard is recorded in progress.json,
    check the killed run does not look finished, and return the shards it had completed."""
    # The capture pauses 2 s after each progress.json it writes, so that a run which records its
    # first shard cannot finish the rest before it is killed (it did, on a fast host, with few
    # shards); eagle3.io.write_json is wrapped before the capture modules import it.
    code = (
        "import json, sys, time\n"
        "import eagle3.io\n"
        "write_json = eagle3.io.write_json\n"
        "def slow_write_json(path, *args, **kwargs):\n"
        "    write_json(path, *args, **kwargs)\n"
        "    if str(path).endswith('progress.json'):\n"
        "        time.sleep(2)\n"
        "eagle3.io.write_json = slow_write_json\n"
        "from eagle3.config import CaptureConfig\n"
        "from eagle3.capture import run_capture\n"
        "run_capture(CaptureConfig.model_validate(json.loads(sys.argv[1])))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg.model_dump(mode="json"))],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    progress = cfg.out / "progress.json"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if progress.is_file() and json.loads(progress.read_text())["shards"]:
                break
            time.sleep(0.01)
        assert proc.poll() is None, (
            f"capture ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        )
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (cfg.out / "manifest.json").exists(), "the killed run must not look finished"
    return json.loads(progress.read_text())["shards"]


def test_sigkill_then_resume_equals_uninterrupted(tiny_llama, prepared_many, tmp_path):
    ref = run_capture(_cfg(tiny_llama, prepared_many, tmp_path / "ref"))
    assert ref.num_shards >= 5

    out = tmp_path / "killed"
    cfg = _cfg(tiny_llama, prepared_many, out)
    done = kill_capture_after_first_shard(cfg)
    assert 1 <= len(done) < ref.num_shards
    with pytest.raises(FileNotFoundError, match="interrupted capture"):
        CaptureManifest.load(out)

    res = run_capture(cfg)
    assert res.resumed_shards == len(done)
    assert res.num_samples == ref.num_samples == NUM and res.num_tokens == ref.num_tokens
    got, want = list(load_captured(out, verify=True)), list(load_captured(ref.out))
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want]
    assert len({s["sample_id"] for s in got}) == NUM
    for a, b in zip(got, want, strict=True):
        for k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"):
            assert torch.equal(a[k], b[k]), (a["sample_id"], k)
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"


def test_corrupt_shard_is_recaptured(tiny_llama, prepared_many, tmp_path):
    """A shard whose bytes no longer match progress.json is dropped (with every later shard) and
    redone."""
    cfg = _cfg(tiny_llama, prepared_many, tmp_path / "c")
    cfg.limit = 12
    first = run_capture(cfg)
    (tmp_path / "c" / "manifest.json").unlink()  # pretend the run died before finishing
    victim = tmp_path / "c" / "shard-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    res = run_capture(cfg)
    assert res.resumed_shards == 1
    assert res.num_samples == first.num_samples == 12
    assert [s["sample_id"] for s in load_captured(res.out, verify=True)] == [
        s["sample_id"] for s in load_captured(first.out)
    ]
