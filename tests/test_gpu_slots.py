"""Per-GPU slots: one gpu-1x worker per GPU, each stage holding its own device's slot
(EAGLE3_GPU_LIMIT="gpu-host-{host}-gpu{device}"), so drafts train side by side; and the train_grid
flow that fans a grid of drafts out as separate train stage runs.

On the CPU two "devices" are two processes run as a gpu-1x worker runs a dispatched stage (the
eagle3-train GPU stage flow, with CUDA_VISIBLE_DEVICES 0 or 1) against one Prefect API (the embedded
test server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "gpu-host-{host}-gpu{device}"

# A train stage run as a gpu-1x worker runs it; after training it keeps its slot until the file
# argv[3] exists (at most 240 s), so that two runs overlap however slowly a loaded host starts them.
WORKER = """
import json, os, sys, time
import eagle3_prefect.tasks.stages as stages
from eagle3.config import TrainConfig
from eagle3_prefect.flows.gpu_stages import train_stage

train = stages.run_stage_function

def train_then_hold(stage, cfg):
    result = train(stage, cfg)
    deadline = time.time() + 240
    while not os.path.exists(sys.argv[3]) and time.time() < deadline:
        time.sleep(0.1)
    return result

stages.run_stage_function = train_then_hold
config = TrainConfig.model_validate(json.loads(sys.argv[1]))
manifest = train_stage(config=config, upstream={}, run_name=sys.argv[2])
print(json.dumps({"wall_s": manifest["wall_s"], "slot_wait_s": manifest["slot_wait_s"]}))
"""


def test_slot_names_per_device(monkeypatch):
    from eagle3_prefect.tasks.stages import gpu_limit_names

    monkeypatch.setenv("EAGLE3_NODE_NAME", "Node-7")
    monkeypatch.setenv("EAGLE3_GPU_LIMIT", TEMPLATE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_limit_names() == ["gpu-host-node-7-gpu3"]
    monkeypatch.setenv(
        "CUDA_VISIBLE_DEVICES", "0,1,2"
    )  # a worker that sees three GPUs takes three slots
    assert gpu_limit_names() == [f"gpu-host-node-7-gpu{i}" for i in range(3)]
    monkeypatch.setenv("EAGLE3_GPU_LIMIT", "gpu-host-{host}")  # the host-wide slot, as before
    assert gpu_limit_names() == ["gpu-host-node-7"]
    monkeypatch.delenv("EAGLE3_GPU_LIMIT")
    assert gpu_limit_names() == []


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings(
        {PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    ):
        with prefect_test_harness(server_startup_timeout=120):
            yield storage


@pytest.fixture(scope="module")
def inputs(tiny_llama, tmp_path_factory):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_captured, write_vocab

    root = tmp_path_factory.mktemp("grid")
    samples, manifest = capture_samples(
        tiny_llama, num=12, aux_layer_ids=(1, 2, 4), min_len=16, max_len=40
    )
    vocab = write_vocab(root / "vocab", 512, frequent_ids(samples, 200, 512))
    return write_captured(root / "cap", samples, manifest, shard_samples=6), vocab


def train_cfg(tiny_llama, inputs, out, **kw):
    from eagle3.config import TrainConfig, deep_merge

    cap, vocab = inputs
    base = dict(
        target=str(tiny_llama),
        captured=str(cap),
        vocab=str(vocab),
        out=out,
        max_steps=4,
        optimizer={"lr": 1e-3},
        schedule={"warmup_steps": 1},
        loader={"max_seq_len": 64, "val_fraction": 0.2},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 4, "save_every": 4, "log_every": 2},
        device="cpu",
    )
    return TrainConfig(**deep_merge(base, kw))


@pytest.mark.slow
def test_two_train_runs_hold_their_own_device_slots_at_once(harness, tiny_llama, inputs, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.settings import PREFECT_API_URL

    host = socket.gethostname().lower()
    names = [TEMPLATE.format(host=host, device=d) for d in (0, 1)]
    with get_client(sync_client=True) as client:
        for name in names:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        OMP_NUM_THREADS="1",
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_LOCAL_STORAGE_PATH=str(harness),
        EAGLE3_GPU_LIMIT=TEMPLATE,
        EAGLE3_INPROCESS="all",
        EAGLE3_NODE_NAME=host,
        PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="INFO",
    )  # an earlier CLI test may have quietened it
    procs, release = [], tmp_path / "release"
    for d in (0, 1):
        cfg = train_cfg(tiny_llama, inputs, tmp_path / f"draft{d}", max_steps=8)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    json.dumps(cfg.model_dump(mode="json")),
                    f"dev{d}",
                    str(release),
                ],
                env={**env, "CUDA_VISIBLE_DEVICES": str(d)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    both_held, deadline = False, time.time() + 300
    try:
        with get_client(sync_client=True) as client:
            while any(p.poll() is None for p in procs) and time.time() < deadline:
                held = [client.read_global_concurrency_limit_by_name(n).active_slots for n in names]
                both_held = both_held or held == [1, 1]
                if both_held:
                    release.touch()
                time.sleep(0.2)
        release.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    for d, (_, err) in enumerate(outs):
        assert f"got GPU slot '{names[d]}'" in err, err[-2000:]
    assert both_held, "the two train runs never held their two device slots at the same moment"
    assert all(json.loads(out.splitlines()[-1])["slot_wait_s"] < 5 for out, _ in outs)


@pytest.mark.slow
def test_train_grid_trains_each_draft(harness, tiny_llama, inputs, tmp_path, monkeypatch):
    from eagle3_prefect.flows.grid import train_grid

    monkeypatch.setenv("EAGLE3_INPROCESS", "all")
    runs = {
        "a": train_cfg(tiny_llama, inputs, tmp_path / "a"),
        "b": train_cfg(tiny_llama, inputs, tmp_path / "b", optimizer={"lr": 3e-3}),
    }
    rows = train_grid(runs, dispatch="local")["rows"]
    assert [r["name"] for r in rows] == ["a", "b"] and all(
        r["steps"] == 4 and not r["cached"] for r in rows
    )
    assert rows[0]["train_loss"] != rows[1]["train_loss"]
    assert all((tmp_path / n / "final" / "model.safetensors").is_file() for n in ("a", "b"))
    again = train_grid(runs, dispatch="local")["rows"]  # unchanged inputs: both cached
    assert all(r["cached"] for r in again)
