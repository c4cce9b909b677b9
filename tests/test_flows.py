"""The Prefect layer on the embedded API (prefect_test_harness): content-hash caching, output
verification, retries, config errors, artifacts, the layer sweep and the retraining gate.

Stages run for real on a tiny target (hf capture, a few training steps), in the test process
(EAGLE3_INPROCESS=all, except where the subprocess path is the point); evaluate is a stand-in
(`fake_evaluate`), because a vLLM engine costs minutes on this CPU: the real one runs in
tests/test_prefect_server.py's slow test.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("EAGLE3_RETRY_BASE_S", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

ASSETS = Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets"


# ------------------------------------------------------------------------------------------ helpers
def tiny_config(target: Path, work_dir: Path, *, eval_prompts: bool = True, **overrides: Any):
    """The cheapest real pipeline: no regenerate, hf capture on CPU, a few training steps."""
    from eagle3.config import PipelineConfig, deep_merge

    raw = {
        "name": "tiny",
        "target": str(target),
        "data": str(ASSETS / "demo_chats.jsonl"),
        "eval_prompts": str(ASSETS / "demo_eval_prompts.jsonl") if eval_prompts else None,
        "work_dir": str(work_dir),
        "regenerate": {"enabled": False},
        "prepare": {"max_seq_len": 160, "limit": 8},
        "capture": {
            "backend": "hf",
            "device": "cpu",
            "dtype": "float32",
            "storage_dtype": "float32",
            "batch_tokens": 512,
            "shard_tokens": 256,
        },
        "vocab": {"draft_vocab_size": 128},
        "train": {
            "loss": {"ttt_steps": 2},
            "schedule": {"warmup_steps": 1},
            "loader": {"max_seq_len": 160, "val_fraction": 0.25},
            "checkpoint": {"eval_every": 3, "save_every": 3, "log_every": 1},
            "runtime": {"dtype": "float32"},
            "max_steps": 3,
            "device": "cpu",
        },
        "evaluate": {
            "num_prompts": 2,
            "max_tokens": 8,
            "max_model_len": 512,
            "baseline": False,
            "dtype": "float32",
        },
    }
    return PipelineConfig.model_validate(deep_merge(raw, overrides))


@dataclass
class FakeEvaluateResult:
    out: Path
    acceptance_length: float
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    chart_path: Path | None = None


def fake_evaluate(cfg) -> FakeEvaluateResult:
    """Stand-in for run_evaluate: τ is a deterministic function of the draft's bytes (or
    EAGLE3_FAKE_TAU); writes results.json and a chart like the real stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = hashlib.sha256()
    for f in sorted(Path(cfg.draft).rglob("*")):
        if f.is_file():
            h.update(f.read_bytes())
    tau = float(os.environ.get("EAGLE3_FAKE_TAU") or 1.0 + int(h.hexdigest()[:4], 16) / 65536)
    per_pos = [round((tau - 1.0) / 3, 4)] * 3
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"acceptance_length": tau, "acceptance_rate_per_position": per_pos})
    )
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar([1, 2, 3], per_pos)
    fig.savefig(out / "acceptance.png", dpi=50)
    plt.close(fig)
    return FakeEvaluateResult(
        out=out,
        acceptance_length=tau,
        acceptance_rate_per_position=per_pos,
        chart_path=out / "acceptance.png",
    )


def run_flow(flow_fn, *args, **kwargs):
    """(final state, flow run id, wall seconds) of one flow call."""
    t0 = time.time()
    state = flow_fn(*args, return_state=True, **kwargs)
    return state, state.state_details.flow_run_id, time.time() - t0


def _read_task_runs(flow_run_id) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return sorted(runs, key=lambda r: r.created)


def task_runs(flow_run_id, timeout_s: float = 30.0) -> list[Any]:
    """Task runs of a flow run, once the API has recorded them all in a final state (task run states
    reach the API through events, a moment after the flow returns)."""
    deadline = time.time() + timeout_s
    previous = None
    while True:
        runs = _read_task_runs(flow_run_id)
        settled = runs and all(r.state is not None and r.state.is_final() for r in runs)
        signature = [(r.id, r.state.name if r.state else None) for r in runs]
        if (settled and signature == previous) or time.time() > deadline:
            return runs
        previous = signature if settled else None
        time.sleep(0.5)


def child_flow_runs(flow_run_id) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
            )
        )


def stage_states(flow_run_id) -> dict[str, str]:
    """{stage task name: state name} of a flow run: "Cached" = skipped, "Completed" = executed."""
    return {r.name: r.state.name for r in task_runs(flow_run_id)}


def artifacts_by_key(flow_run_id=None) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flt = (
        ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        if flow_run_id
        else None
    )
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=flt) if flt else client.read_artifacts()
    return {a.key: a for a in arts if a.key}


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One embedded Prefect API for the session; results (the cache records) in a temp dir."""
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
def fast_stages():
    """Stages in the test process; evaluate replaced by fake_evaluate."""
    import dataclasses

    from eagle3.stages import STAGES

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_INPROCESS", "all")
        mp.setitem(
            STAGES,
            "evaluate",
            dataclasses.replace(STAGES["evaluate"], function=f"{__name__}:fake_evaluate"),
        )
        yield


@pytest.fixture(scope="module")
def base(prefect_harness, fast_stages, tiny_llama, tmp_path_factory):
    """The tiny pipeline's config and its first (uncached) run."""
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    cfg = tiny_config(tiny_llama, tmp_path_factory.mktemp("work"))
    state, run_id, wall = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert state.is_completed(), state.message
    return {"cfg": cfg, "run_id": run_id, "wall_s": wall, "manifests": state.result()}


STAGES = ["prepare", "capture", "vocab", "train", "export", "evaluate"]


# ------------------------------------------------------------------------------------------ tests
def test_first_run_executes_every_stage_and_reports(base):
    states = stage_states(base["run_id"])
    assert {s: states.get(s) for s in STAGES} == dict.fromkeys(STAGES, "Completed")
    m = base["manifests"]
    assert list(m) == STAGES
    for stage, man in m.items():
        assert man["content_sha256"] and man["num_files"] > 0, stage
        json.dumps(man)  # JSON-able, no tensors
    assert m["evaluate"]["result"]["acceptance_length"] >= 1.0
    arts = artifacts_by_key(base["run_id"])
    for key in (
        "tiny-pipeline",
        "tiny-prepare-summary",
        "tiny-capture-summary",
        "tiny-capture-progress",
        "tiny-train-progress",
        "tiny-train-curves",
        "tiny-draft",
        "tiny-evaluate-tau",
    ):
        assert key in arts, (key, sorted(arts))
    assert "tiny-train-metrics" not in arts  # the per-step metrics stay in their file
    assert "logs/metrics.jsonl" in arts["tiny-train-curves"].data
    assert arts["tiny-capture-progress"].data == 100.0
    assert "data:image/png;base64," in arts["tiny-evaluate-tau"].data
    draft = str(Path(m["export"]["out"]).resolve())  # a path to copy, not a file:// link
    assert f"```text\n{draft}\n```" in arts["tiny-draft"].data, arts["tiny-draft"].data
    assert "file://" not in arts["tiny-draft"].data + arts["tiny-pipeline"].data
    # the run is named for its config and the moment; its state message and its summary lead
    # with the result (the stand-in evaluate gives τ only) and the draft's path
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(base["run_id"])
    assert re.fullmatch(r"tiny · \d{4}-\d\d-\d\d \d\d:\d\d", run.name), run.name
    tau = m["evaluate"]["result"]["acceptance_length"]
    assert run.state.message == f"draft τ {tau:.2f}; draft {draft}", run.state.message
    summary = arts["tiny-pipeline"].data
    assert summary.startswith(f"# {run.name}\n\n**{run.state.message}**"), summary[:300]
    assert "tiny-train-curves" in summary and "tiny-evaluate-tau" in summary, summary


def test_unchanged_rerun_executes_nothing_and_is_fast(base):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    state, run_id, wall = run_flow(eagle3_pipeline, base["cfg"], dispatch="local")
    assert state.is_completed()
    states = stage_states(run_id)
    assert {s: states.get(s) for s in STAGES} == dict.fromkeys(STAGES, "Cached"), states
    assert all(m["cached"] for m in state.result().values())
    assert wall <= 10.0, f"cached rerun took {wall:.1f} s"
    print(f"first run {base['wall_s']:.1f} s, cached rerun {wall:.1f} s")


def test_cache_records_live_in_the_work_dir(base, prefect_harness):
    """Every stage's cache record is a file under <work_dir>/.prefect-results, named by its content
    key; Prefect's process-wide result storage (PREFECT_LOCAL_STORAGE_PATH, ~/.prefect/storage by
    default) holds none."""
    records = Path(base["cfg"].work_dir) / ".prefect-results"
    for stage, m in base["manifests"].items():
        assert (records / m["key"]).is_file(), (stage, sorted(p.name for p in records.iterdir()))
    assert not [p for p in Path(prefect_harness).rglob("eagle3-*")], sorted(
        Path(prefect_harness).rglob("*")
    )


def test_lost_result_storage_adopts_verified_outputs(base, prefect_harness):
    """Prefect's cache records gone (the work dir's .prefect-results wiped): the stamps still
    verify, so no stage recomputes; the tasks just re-record their manifests."""
    import shutil

    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    stamps = {
        s: json.loads((Path(m["out"]) / ".eagle3-stage.json").read_text())["finished_at"]
        for s, m in base["manifests"].items()
    }
    shutil.rmtree(Path(base["cfg"].work_dir) / ".prefect-results")
    state, run_id, wall = run_flow(eagle3_pipeline, base["cfg"], dispatch="local")
    assert state.is_completed(), state.message
    assert set(stage_states(run_id).values()) == {"Completed"}
    after = {
        s: json.loads((Path(m["out"]) / ".eagle3-stage.json").read_text())["finished_at"]
        for s, m in state.result().items()
    }
    assert after == stamps
    assert wall <= 10.0
    state, run_id, _ = run_flow(eagle3_pipeline, base["cfg"], dispatch="local")
    assert set(stage_states(run_id).values()) == {"Cached"}


def test_train_config_change_reruns_train_export_evaluate_only(base):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    cfg = base["cfg"].model_copy(deep=True)
    cfg.train.optimizer.lr = 3e-4
    state, run_id, _ = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert state.is_completed(), state.message
    states = stage_states(run_id)
    assert {s: states[s] for s in STAGES} == {
        "prepare": "Cached",
        "capture": "Cached",
        "vocab": "Cached",
        "train": "Completed",
        "export": "Completed",
        "evaluate": "Completed",
    }, states


def test_deleted_capture_shard_is_detected_and_capture_reruns(base):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    cfg = base["cfg"]
    shards = sorted(Path(cfg.resolved().capture.out).rglob("*.safetensors"))
    assert len(shards) >= 2, shards
    shards[-1].unlink()
    state, run_id, _ = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert state.is_completed(), state.message
    states = stage_states(run_id)
    assert states["prepare"] == "Cached" and states["vocab"] == "Cached"
    assert states["capture"] == "Completed", states
    assert shards[-1].is_file()
    # the recaptured shard is byte-identical, so the next run is fully cached again
    state, run_id, _ = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert set(stage_states(run_id).values()) == {"Cached"}


def test_altered_output_file_is_detected(base):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    vocab_file = Path(base["cfg"].resolved().vocab.out) / "coverage.json"
    vocab_file.write_text(vocab_file.read_text() + " ")
    state, run_id, _ = run_flow(eagle3_pipeline, base["cfg"], dispatch="local")
    assert state.is_completed()
    assert stage_states(run_id)["vocab"] == "Completed"


def test_config_error_fails_fast_without_retries(base):
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    cfg = base["cfg"].model_copy(deep=True)
    cfg.vocab.draft_vocab_size = 10_000_000
    t0 = time.time()
    state, run_id, _ = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert state.is_failed()
    assert "draft_vocab_size" in (state.message or ""), state.message
    vocab = [r for r in task_runs(run_id) if r.name == "vocab"]
    assert len(vocab) == 1 and vocab[0].run_count == 1 and vocab[0].state.name == "Failed"
    assert time.time() - t0 < 30


def test_config_checked_before_any_stage_and_work_dir_locked(base, tmp_path):
    """A bad layer id fails the pipeline (and a sweep) as Failed before any task runs; a run on a
    work dir another process holds fails at once, naming the holder."""
    from eagle3_prefect.flows.pipeline import eagle3_pipeline
    from eagle3_prefect.flows.sweep import layer_sweep

    cfg = base["cfg"].model_copy(deep=True)
    cfg.capture.aux_layer_ids = [1, 2, 9]
    t0 = time.time()
    state, run_id, _ = run_flow(eagle3_pipeline, cfg, dispatch="local")
    assert state.is_failed() and state.type.value == "FAILED", state
    assert (
        "capture.aux_layer_ids = [1, 2, 9]: id(s) [9] out of range for this 5-layer target; use "
        "ids in 1..4" in state.message
    )
    assert _read_task_runs(run_id) == []
    state, run_id, _ = run_flow(layer_sweep, base["cfg"], [[1, 2], [2, 7]], dispatch="local")
    assert (
        state.is_failed() and "layer_sets[1] = [2, 7]: id(s) [7] out of range" in state.message
    ), state.message
    assert _read_task_runs(run_id) == []
    assert time.time() - t0 < 60

    import subprocess

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from eagle3.lock import dir_lock\n"
            "with dir_lock(sys.argv[1], 'pipeline work_dir'):\n    print('held', flush=True); "
            "time.sleep(600)",
            str(base["cfg"].work_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        state, run_id, _ = run_flow(eagle3_pipeline, base["cfg"], dispatch="local")
        assert state.is_failed() and f"is being written by pid {holder.pid}" in state.message, (
            state.message
        )
        assert _read_task_runs(run_id) == []
    finally:
        holder.kill()
        holder.wait(timeout=10)
    state, _, _ = run_flow(
        eagle3_pipeline, base["cfg"], dispatch="local"
    )  # the killed holder freed it
    assert state.is_completed(), state.message


def test_gpu_slot_wait_is_measured_apart_from_stage_time(prefect_harness, monkeypatch):
    """Waiting for the host's GPU slot is reported as slot_wait_s, not as stage time (wall_s)."""
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    from eagle3_prefect.tasks.stages import gpu_slot

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name="gpu-host-slot-test", limit=1)
        )
    monkeypatch.setenv("EAGLE3_GPU_LIMIT", "gpu-host-slot-test")
    held, release, hold_s = threading.Event(), threading.Event(), 4.0

    def another_stage() -> None:
        with concurrency("gpu-host-slot-test", occupy=1, strict=True):
            held.set()
            release.wait(60)

    @flow(name="slot-wait")
    def take_slot() -> dict:
        waited: dict = {}
        # the other stage frees the slot hold_s after this flow asks for it, however long the flow
        # took to start (on a loaded 2-core host that took over 2 s, and a fixed hold left the wait
        # shorter than hold_s / 2)
        threading.Timer(hold_s, release.set).start()
        with gpu_slot("train", waited):
            pass
        return waited

    t = threading.Thread(target=another_stage)
    t.start()
    assert held.wait(60)
    waited = take_slot()
    t.join()
    assert waited["slot_wait_s"] >= hold_s / 2, waited


def test_transient_subprocess_crash_is_retried(base, monkeypatch, tmp_path):
    """capture's child process dies once (exit 1, no result): the task retries and the flow
    completes."""
    from prefect import flow

    import eagle3_prefect.tasks.subprocess_runner as runner
    from eagle3_prefect.flows.dispatch import StageRunner

    real = runner.build_command
    marker = tmp_path / "crashed-once"

    def crash_once(stage, config_json, result_json):
        cmd = real(stage, config_json, result_json)
        code = (
            "import os, sys; m = sys.argv[1]\n"
            "if not os.path.exists(m):\n    open(m, 'w').close(); print('simulated crash', "
            "flush=True); os._exit(1)\n"
            "os.execv(sys.argv[2], sys.argv[2:])"
        )
        return [sys.executable, "-c", code, str(marker), *cmd]

    monkeypatch.setattr(runner, "build_command", crash_once)
    monkeypatch.setenv("EAGLE3_INPROCESS", "")
    cfg = base["cfg"].model_copy(deep=True)
    cfg.capture.limit = 3  # a new capture key: the stage must really run
    cfg.capture.out = tmp_path / "captured"

    @flow(name="capture-only")
    def capture_only(cfg):
        run = StageRunner(cfg.resolved(), dispatch="local")
        run("prepare")
        return run("capture", "prepare")

    state, run_id, _ = run_flow(capture_only, cfg)
    assert state.is_completed(), state.message
    cap = [r for r in task_runs(run_id) if r.name == "capture"][0]
    assert cap.run_count == 2 and cap.state.name == "Completed"
    assert marker.exists()
    assert state.result()["result"]["num_samples"] == 3


def test_layer_sweep_compares_and_picks_a_winner(base):
    from eagle3_prefect.flows.sweep import layer_sweep

    state, run_id, wall = run_flow(
        layer_sweep, base["cfg"], [[1, 2, 3], [2, 3, 4]], max_concurrency=2, dispatch="local"
    )
    assert state.is_completed(), state.message
    out = state.result()
    rows = out["rows"]
    assert [r["layers"] for r in rows] == [[1, 2, 3], [2, 3, 4]]
    assert all(r["tau"] is not None and r["train_loss"] is not None for r in rows)
    assert out["winner"]["tau"] == max(r["tau"] for r in rows)
    names = [r.name for r in task_runs(run_id)]
    assert names.count("prepare") == names.count("vocab") == 1  # shared by the branches
    assert names.count("capture") == names.count("train") == names.count("evaluate") == 2
    assert stage_states(run_id)["prepare"] == "Cached"  # and with the base run
    arts = artifacts_by_key(run_id)
    table = json.loads(arts["tiny-sweep-table"].data)
    assert len(table) == 2 and sum(r["winner"] == "yes" for r in table) == 1
    assert "data:image/png;base64," in arts["tiny-sweep-winner"].data
    assert (Path(base["cfg"].work_dir) / "sweep" / "comparison.png").is_file()
    print(f"sweep of 2 layer sets: {wall:.1f} s")


def test_retrain_promotes_better_keeps_current_when_worse(base, tmp_path, monkeypatch):
    from eagle3_prefect.flows.retrain import retrain

    data = tmp_path / "chats.jsonl"
    lines = (ASSETS / "demo_chats.jsonl").read_text().splitlines()
    data.write_text("\n".join(lines[:10]) + "\n")
    cfg = base["cfg"].model_copy(deep=True)
    cfg.data, cfg.work_dir = str(data), tmp_path / "retrain"
    cfg.prepare.limit = 6

    monkeypatch.setenv("EAGLE3_FAKE_TAU", "1.5")
    first = retrain(cfg)
    assert first["promoted"] and first["current"]["tau"] == 1.5
    link = cfg.work_dir / "current-draft"
    assert link.resolve() == Path(first["candidate"]["draft"]).resolve()

    state, run_id, _ = run_flow(
        retrain, cfg
    )  # unchanged data: every stage cached, nothing promoted
    again = state.result()
    assert not again["promoted"] and "unchanged" in again["reason"]
    (pipeline_run,) = child_flow_runs(run_id)
    states = stage_states(pipeline_run.id)
    assert set(states) >= set(STAGES) and set(states.values()) == {"Cached"}, states

    data.write_text("\n".join(lines[2:12]) + "\n")  # new traffic arrived; its draft evaluates worse
    monkeypatch.setenv("EAGLE3_FAKE_TAU", "1.2")
    worse = retrain(cfg)
    assert not worse["promoted"]
    assert worse["current"]["draft"] == first["candidate"]["draft"]
    assert worse["candidate"]["draft"] != first["candidate"]["draft"]
    assert link.resolve() == Path(first["candidate"]["draft"]).resolve()
    history = [json.loads(x) for x in (cfg.work_dir / "drafts.jsonl").read_text().splitlines()]
    assert [h["promoted"] for h in history] == [True, False, False]


def test_blocks_keep_the_token_secret(prefect_harness, tiny_llama, tmp_path):
    from eagle3_prefect.blocks.eagle3_blocks import (
        HardwareProfile,
        StorageLocation,
        TargetModelSource,
    )
    from eagle3_prefect.blocks.register import main as register

    assert (
        register(["--example"]) == 0
    )  # the documented `python -m eagle3_prefect.blocks.register --example`
    assert HardwareProfile.load("demo").work_pool == "gpu-1x"
    src = TargetModelSource(hub_id="org/model", revision="abc123", token="hf_secret_value")
    assert "hf_secret_value" not in repr(src) and "hf_secret_value" not in str(src.model_dump())
    src.save("tiny-hub", overwrite=True)
    loaded = TargetModelSource.load("tiny-hub")
    assert loaded.token.get_secret_value() == "hf_secret_value"
    assert TargetModelSource(path=str(tiny_llama)).resolve(tmp_path) == str(tiny_llama)
    with pytest.raises(ValueError, match="path.*hub_id"):
        TargetModelSource()
    with pytest.raises(ValueError, match="tensor_parallel_size = 8 exceeds num_gpus = 1"):
        HardwareProfile(num_gpus=1, tensor_parallel_size=8)
    cfg = tiny_config(tiny_llama, tmp_path / "w")
    assert (
        StorageLocation(base_path=str(tmp_path / "runs")).apply(cfg).work_dir
        == tmp_path / "runs" / "tiny"
    )


def test_fetch_target_task_stamps_the_target_and_caches(prefect_harness, smollm2, tmp_path):
    """The fetch-target task (pipeline `fetch_target:`) on a copy of an already fetched SmolLM2 dir:
    the library reuses it (no conversion), the task stamps the dir, a second run is a verified cache
    hit, and the in-process pipeline's ensure_target accepts it as well."""
    import shutil

    from prefect import flow

    from eagle3.pipeline import ensure_target
    from eagle3_prefect.tasks.manifest import read_stamp
    from eagle3_prefect.tasks.stages import run_stage

    target = tmp_path / "smol"
    shutil.copytree(smollm2, target)
    cfg = tiny_config(target, tmp_path / "w", fetch_target="smollm2-135m-instruct")

    @flow(name="fetch-target-test")
    def fetch() -> dict:
        return run_stage("fetch-target", cfg.fetch_target_config())

    first, second = fetch(), fetch()
    assert (
        first["cached"] is False and first["result"]["reused"] is True and second["cached"] is True
    )
    assert (
        read_stamp(target)["status"] == "done"
        and "model.safetensors" in read_stamp(target)["files"]
    )
    ensure_target(cfg)  # reuses (the stamp is a dot-file, not part of the fetched files)


@pytest.mark.slow
def test_eagle3_run_uses_the_flow_and_caches_across_processes(tiny_llama, tmp_path):
    """`eagle3 run --config FILE` runs the Prefect flow on the embedded API; a second invocation (a
    new process, a new embedded API) executes no stage."""
    import subprocess

    import yaml

    cfg = tiny_config(tiny_llama, tmp_path / "work", eval_prompts=False)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
    }
    for k in (
        "EAGLE3_INPROCESS",
        "PREFECT_API_URL",
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "VLLM_LOGGING_LEVEL",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",
    ):
        env.pop(
            k, None
        )  # what `eagle3 run` sets by itself (flows/__init__.py, eagle3.console) is under test
    walls = []
    for _ in range(2):
        t0 = time.time()
        p = subprocess.run(
            [sys.executable, "-m", "eagle3.cli", "run", "--config", str(path)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        walls.append(time.time() - t0)
        assert p.returncode == 0, p.stderr[-3000:]
        manifests = json.loads((tmp_path / "work" / "run_summary.json").read_text())["stages"]
        assert list(manifests) == ["prepare", "capture", "vocab", "train", "export"]
        # quiet by default: one line per stage, no engine/Prefect INFO chatter, no traceback (the
        # telemetry heartbeat's "database is locked"), and a summary table at the end
        assert "Traceback" not in p.stderr and "database is locked" not in p.stderr, p.stderr[
            -3000:
        ]
        assert " INFO " not in p.stderr and "| INFO" not in p.stderr, p.stderr[-3000:]
        # offline (this machine), the embedded API's telemetry would log "ERROR | prefect.server.
        # services.telemetry - Failed to send telemetry" here: an ERROR only when ours failed
        assert "telemetry" not in p.stderr and "| ERROR" not in p.stderr, p.stderr[-3000:]
        assert all(f"] {s}" in p.stderr for s in manifests), p.stderr
        assert "key figure" in p.stdout and "run_summary.json" in p.stdout, p.stdout
    assert all(m["cached"] for m in manifests.values()), manifests
    print(f"eagle3 run: first {walls[0]:.1f} s, second (all cached) {walls[1]:.1f} s")
