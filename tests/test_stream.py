"""Streaming (bounded-disk) mode: capture and train at once through a capped spool.

A tiny target (hf capture backend on CPU) and a prepared set whose capture over 3 epochs is more
than 5x the spool cap: training completes, a watcher thread sampling the spool's size (temp files
included) never sees it above the cap, and every training sample is trained on exactly once per
epoch. Both sides are SIGKILLed mid-run (as processes) and resumed; the Prefect flow runs both sides
concurrently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from eagle3.config import ConfigError, PipelineConfig, StreamConfig
from eagle3.spool_files import epoch_order, spool_bytes
from eagle3.train.stream import count_packed_rows, read_samples_log
from test_capture import make_prepared
from test_flows import prefect_harness  # noqa: F401 - the embedded Prefect API fixture

CAP_GB = 0.0012  # 1.2 MB; 3 epochs of the 40-sample set capture ~7.3 MB


@pytest.fixture(scope="module")
def stream_inputs(tiny_llama, tmp_path_factory):
    """(target, prepared dir, vocab dir) shared by the tests."""
    from tests.synthetic_capture import frequent_ids, write_vocab

    from eagle3.prepared import load_prepared

    base = tmp_path_factory.mktemp("stream-inputs")
    prepared = make_prepared(tiny_llama, base / "prepared", num=40, step=8)
    ids = [{"input_ids": r} for r in load_prepared(prepared)["input_ids"]]
    vocab = write_vocab(base / "vocab", 512, frequent_ids(ids, 64, 512))
    return tiny_llama, prepared, vocab


def stream_config(inputs, work: Path, **stream) -> PipelineConfig:
    target, prepared, vocab = inputs
    return PipelineConfig.model_validate(
        {
            "name": "stream",
            "target": str(target),
            "data": "unused-prepared-is-given",
            "work_dir": str(work),
            "regenerate": {"enabled": False},
            "capture": {
                "data": str(prepared),
                "backend": "hf",
                "device": "cpu",
                "dtype": "float32",
                "aux_layer_ids": [1, 2, 4],
                "batch_tokens": 512,
                "shard_tokens": 128,
            },
            "vocab": {"out": str(vocab)},
            "train": {
                "vocab": str(vocab),
                "loss": {"ttt_steps": 2},
                "loader": {"max_seq_len": 128, "val_fraction": 0.05},
                "schedule": {"warmup_steps": 2},
                "checkpoint": {"eval_every": 20, "save_every": 1000, "log_every": 5},
                "runtime": {"dtype": "float32"},
                "optimizer": {"lr": 1e-3},
                "epochs": 3,
                "device": "cpu",
            },
            "stream": {
                "enabled": True,
                "spool_cap_gb": CAP_GB,
                "poll_interval_s": 0.02,
                "stall_timeout_s": 60,
                **stream,
            },
        }
    )


class SpoolWatcher:
    """Samples the spool's total size (every file, temp files included) until stopped; keeps the
    maximum."""

    def __init__(self, spool: Path):
        self.spool, self.peak_bytes, self.samples = spool, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.spool.is_dir():
                self.peak_bytes = max(self.peak_bytes, spool_bytes(self.spool))
                self.samples += 1
            time.sleep(0.0005)

    def __enter__(self) -> SpoolWatcher:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def check_exactly_once(work: Path, epochs: int = 3) -> None:
    """Every training row of the spool header is in the trained-on log once per epoch, and no shard
    is left."""
    header = json.loads((work / "spool" / "stream.json").read_text())
    got = read_samples_log(work / "train")
    assert sorted(got) == list(range(epochs))
    for epoch, rows in got.items():
        assert sorted(rows) == sorted(header["train_rows"]), (
            f"epoch {epoch}: lost or repeated samples"
        )
    left = [p.name for p in (work / "spool").rglob("*.safetensors")]
    assert not left, f"shards left in the spool after training: {left}"


def test_stream_trains_through_a_spool_five_times_smaller_than_the_capture(stream_inputs, tmp_path):
    from eagle3.stream import run_stream

    cfg = stream_config(stream_inputs, tmp_path)
    cap = cfg.stream.spool_cap_bytes
    with SpoolWatcher(tmp_path / "spool") as w:
        res = run_stream(cfg)
    assert res.capture.bytes_written >= 5 * cap, (res.capture.bytes_written, cap)
    assert w.samples > 100 and 0 < w.peak_bytes <= cap, (w.peak_bytes, cap)
    assert res.capture.wait_s > 0, "the producer never waited: the cap did not bind"
    header = json.loads((tmp_path / "spool" / "stream.json").read_text())
    rows = sum(
        count_packed_rows(
            [header["row_tokens"][i] for i in epoch_order(header["train_rows"], 0, e)], 128
        )
        for e in range(3)
    )
    assert res.train.steps == rows  # batch 1: one step per packed row, every epoch
    assert (res.train.final_dir / "model.safetensors").is_file() and res.train.val_metrics
    check_exactly_once(tmp_path)
    assert (
        len(list((tmp_path / "train" / "checkpoints").glob("step-*"))) == 1
    )  # extra checkpoints pruned


def test_config_errors_name_the_fields(stream_inputs, tmp_path):
    from eagle3.stream import run_stream

    with pytest.raises(ValueError, match="spool_cap_gb"):
        StreamConfig(spool_cap_gb=0)
    fractional = stream_config(stream_inputs, tmp_path / "a")
    fractional.train.epochs = 1.5
    with pytest.raises(ConfigError, match="train.epochs = 1.5"):
        fractional.stream_stages()
    small = stream_config(stream_inputs, tmp_path / "b", spool_cap_gb=0.0004)
    with pytest.raises(ConfigError, match=r"stream.spool_cap_gb = 0.0004 .*capture.shard_tokens"):
        run_stream(small)
    from eagle3.train.stream import SpoolSource

    consume = stream_config(stream_inputs, tmp_path / "c").stream_stages()[1]
    loader = consume.loader.model_copy(update={"preload": True})
    for update, message in (
        ({"aux_layer_ids": [1, 2]}, "train.aux_layer_ids is not supported"),
        ({"loader": loader}, r"train.loader.preload = true is not supported"),
    ):
        with pytest.raises(ConfigError, match=message):
            SpoolSource(consume.model_copy(update=update))


def _side(stage: str, config: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "eagle3.cli", stage, "--config", str(config)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert proc.poll() is None, (
            f"{what}: process ended first: {proc.stderr.read().decode()[-3000:]}"
        )
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_sigkill_of_both_sides_resumes_and_trains_every_sample_once(stream_inputs, tmp_path):
    """Consumer killed after it released shards, producer killed while blocked on the full spool (or
    writing); both restarted as fresh processes: training completes, each sample once per epoch,
    disk never above the cap."""
    cfg = stream_config(stream_inputs, tmp_path)
    config = tmp_path / "stream.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    spool = tmp_path / "spool"
    with SpoolWatcher(spool) as w:
        producer, consumer = _side("stream-capture", config), _side("stream-train", config)
        try:
            _wait_for(
                lambda: _json(spool / "consumed.json").get("released_below", 0) >= 3,
                consumer,
                "a release",
            )
            _kill(consumer)
            released = _json(spool / "consumed.json")["released_below"]
            _wait_for(
                lambda: _json(spool / "ledger.json").get("blocked_bytes", 0) > 0,
                producer,
                "back-pressure",
            )
            _kill(producer)
            assert not _json(spool / "ledger.json").get("done")
            producer, consumer = _side("stream-capture", config), _side("stream-train", config)
            for p in (producer, consumer):
                _, err = p.communicate(timeout=240)
                assert p.returncode == 0, err.decode()[-3000:]
        finally:
            for p in (producer, consumer):
                if p.poll() is None:
                    _kill(p)
    assert w.peak_bytes <= cfg.stream.spool_cap_bytes, (w.peak_bytes, cfg.stream.spool_cap_bytes)
    assert _json(spool / "consumed.json")["released_below"] > released
    check_exactly_once(tmp_path)
    state = _json(next((tmp_path / "train" / "checkpoints").glob("step-*")) / "trainer_state.json")
    assert state["epoch"] == 2 and state["stream_sample"] == 0  # the end of the last epoch


@pytest.mark.usefixtures("prefect_harness")
def test_prefect_flow_runs_both_sides_concurrently(stream_inputs, tmp_path, monkeypatch):
    from eagle3_prefect.flows.streaming import streaming

    monkeypatch.setenv("EAGLE3_INPROCESS", "all")
    cfg = stream_config(stream_inputs, tmp_path)
    with SpoolWatcher(tmp_path / "spool") as w:
        state = streaming(cfg, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert set(result) == {"stream-capture", "stream-train"}
    assert result["stream-capture"]["wait_s"] > 0 and result["stream-train"]["steps"] > 0
    assert w.peak_bytes <= cfg.stream.spool_cap_bytes
    check_exactly_once(tmp_path)


def pipeline_stream_config(tiny_llama, tmp_path) -> PipelineConfig:
    assets = Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets"
    return PipelineConfig.model_validate(
        {
            "name": "stream-run",
            "target": str(tiny_llama),
            "data": str(assets / "demo_chats.jsonl"),
            "work_dir": str(tmp_path),
            "regenerate": {"enabled": False},
            "prepare": {"max_seq_len": 128, "limit": 24},
            "capture": {
                "backend": "hf",
                "device": "cpu",
                "dtype": "float32",
                "aux_layer_ids": [1, 2, 4],
                "batch_tokens": 512,
                "shard_tokens": 128,
            },
            "vocab": {"draft_vocab_size": 64},
            "train": {
                "loss": {"ttt_steps": 2},
                "loader": {"max_seq_len": 128, "val_fraction": 0.1},
                "schedule": {"warmup_steps": 2},
                "checkpoint": {"eval_every": 20, "save_every": 1000, "log_every": 5},
                "runtime": {"dtype": "float32"},
                "epochs": 2,
                "device": "cpu",
            },
            "stream": {
                "enabled": True,
                "spool_cap_gb": 0.0016,
                "poll_interval_s": 0.02,
                "stall_timeout_s": 60,
            },
        }
    )


def test_eagle3_run_streams_when_enabled(tiny_llama, tmp_path):
    """`eagle3 run` (in-process) with stream.enabled: prepare -> vocab -> capture+train via the
    spool -> export."""
    from eagle3.pipeline import enabled_stages, run_pipeline

    cfg = pipeline_stream_config(tiny_llama, tmp_path)
    assert enabled_stages(cfg) == ["prepare", "vocab", "stream", "export"]
    with SpoolWatcher(tmp_path / "spool") as w:
        res = run_pipeline(cfg)
    assert res.stages["stream"].train.steps > 0 and w.peak_bytes <= cfg.stream.spool_cap_bytes
    assert not (tmp_path / "captured").exists()  # nothing captured offline
    assert (Path(res.stages["export"].out) / "model.safetensors").is_file()


def test_pipeline_flow_streams_when_enabled(
    tiny_llama,
    tmp_path,
    monkeypatch,
    prefect_harness,  # noqa: F811
):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    monkeypatch.setenv("EAGLE3_INPROCESS", "all")
    cfg = pipeline_stream_config(tiny_llama, tmp_path)
    with SpoolWatcher(tmp_path / "spool") as w:
        manifests = eagle3_pipeline(cfg, dispatch="local")
    assert "capture" not in manifests and manifests["train"]["result"]["steps"] > 0
    assert w.peak_bytes <= cfg.stream.spool_cap_bytes
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_stream_capture_refuses_the_worker_writer(tmp_path):
    """capture.writer = worker is not wired into the spool (it writes each shard in the driver after
    waiting for room): a clear error naming the field and the fix, recorded in the ledger for the
    consumer, no silent fallback."""
    from eagle3.capture.spool import run_stream_capture
    from eagle3.config import ConfigError, StreamCaptureConfig

    cfg = StreamCaptureConfig(
        target=str(tmp_path / "t"),
        data=str(tmp_path / "d"),
        out=tmp_path / "spool",
        writer="worker",
    )
    with pytest.raises(
        ConfigError,
        match="capture.writer = 'worker' is not supported in streaming mode.*writer: driver",
    ):
        run_stream_capture(cfg)
    assert "writer" in json.loads((tmp_path / "spool" / "ledger.json").read_text())["error"]
