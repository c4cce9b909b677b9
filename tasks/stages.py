"""One Prefect task per pipeline stage. Each loads its stage config, calls ONE library function
(its `function` in the stage registry, eagle3.stages), and returns a small JSON-able manifest:

    {"stage", "key", "out", "content_sha256", "num_files", "num_bytes", "wall_s", "result": {...}}

Caching: `StageCachePolicy` keys a run by content (tasks/manifest.py); `run_stage` only accepts a
cache hit after the stamp in the output dir verifies, otherwise it forces a refresh.
Retries: transient failures only (tasks/errors.py). GPU-heavy stages run in a subprocess
(tasks/subprocess_runner.py) whose output streams into the task's log.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import CachePolicy
from prefect.tasks import exponential_backoff

from eagle3.config import ConfigError, StageConfig
from eagle3.stages import STAGES, build_stage_config, jsonable, run_stage_function
from eagle3_prefect.tasks import artifacts
from eagle3_prefect.tasks.errors import retry_transient_only
from eagle3_prefect.tasks.manifest import (
    MANIFEST_KEYS,
    config_dict,
    content_sha256,
    describe_resume_point,
    list_outputs,
    prepare_out_dir,
    read_stamp,
    stage_cache_key,
    verify_outputs,
    write_stamp,
)
from eagle3_prefect.tasks.progress import make_probe
from eagle3_prefect.tasks.subprocess_runner import run_stage_subprocess

#: stages with a GPU stage flow and deployments of their own (flows/gpu_stages.py, prefect.yaml)
GPU_STAGES = tuple(n for n, s in STAGES.items() if s.gpu)
#: stages whose library call runs in a fresh subprocess (GPU state, engines, hard timeouts): the GPU
#: stages plus synthesize (an engine of the target, but no deployment of its own)
SUBPROCESS_STAGES = tuple(n for n, s in STAGES.items() if s.subprocess)
#: stages that get a progress artifact
PROGRESS_STAGES = ("capture", "train")

NUM_RETRIES = int(os.environ.get("EAGLE3_NUM_RETRIES", "2"))
#: lease on the GPU slot: renewed every 3/4 of it while the stage runs; a holder whose host died
#: frees the slot when its lease runs out (Prefect's repossessor), so this bounds how long the
#: stage's next run waits for it
GPU_LEASE_S = max(
    60.0, float(os.environ.get("EAGLE3_GPU_LEASE_S", "120"))
)  # Prefect's minimum is 60 s
RETRY_BASE_S = float(os.environ.get("EAGLE3_RETRY_BASE_S", "10"))
#: the stage tasks' cache records (Prefect's result storage) go to <work_dir>/.prefect-results, not
#: to Prefect's process-wide default (~/.prefect/storage whatever PREFECT_HOME says): each work
#: dir's records are its own
RESULT_DIR = ".prefect-results"


@functools.cache
def _load_storage_block(ref: str) -> Any:
    from prefect.blocks.core import Block

    try:
        return Block.load(ref)
    except ValueError as e:
        raise ConfigError(
            f"EAGLE3_RESULT_STORAGE = {ref!r}: no such block on this server ({e}); "
            "save a filesystem block first (e.g. remote-file-system/<name>) or unset "
            "it to keep the cache records under the work dir"
        ) from None


def result_storage(cache_dir: str | Path | None) -> Any:
    """Where the stage tasks keep their cache records: the saved filesystem block
    EAGLE3_RESULT_STORAGE names (`<block type slug>/<name>`: to share them across hosts on purpose),
    else `cache_dir` (a local directory, <work_dir>/.prefect-results), else Prefect's default
    (None)."""
    ref = os.environ.get("EAGLE3_RESULT_STORAGE", "").strip()
    if ref:
        return _load_storage_block(ref)
    if cache_dir is None:
        return None
    # prefect makes a path a LocalFileSystem (a block must be saved first)
    return Path(cache_dir).resolve()


def runs_in_subprocess(stage: str) -> bool:
    """GPU stages run in a subprocess, unless EAGLE3_INPROCESS names them ("all" or
    "capture,train")."""
    inproc = {
        s.strip() for s in os.environ.get("EAGLE3_INPROCESS", "").lower().split(",") if s.strip()
    }
    return stage in SUBPROCESS_STAGES and not (inproc & {"1", "all", "true", stage})


@dataclass
class StageCachePolicy(CachePolicy):
    """Cache key = stage code version + stage config + upstream content hashes + external inputs."""

    stage: str = ""

    def compute_key(
        self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        return stage_cache_key(
            self.stage, inputs["config"], slim_upstream(inputs.get("upstream") or {})
        )


def slim_upstream(upstream: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What a stage needs to know about its inputs: where they are and their content hash."""
    return {
        k: {"out": m["out"], "content_sha256": m["content_sha256"]} for k, m in upstream.items()
    }


def as_stage_config(stage: str, config: StageConfig | dict[str, Any]) -> StageConfig:
    if isinstance(config, StageConfig):
        return config
    return build_stage_config(stage, dict(config), source=f"{stage} task parameters")


def gpu_limit_names() -> list[str]:
    """Names of the global concurrency limits guarding the GPUs this process uses, from
    EAGLE3_GPU_LIMIT (the GPU deployments set it, e.g. "gpu-host-{host}"); [] on the embedded
    default (no limit). {host} is EAGLE3_NODE_NAME when set (a Kubernetes pod's hostname is the
    pod's, not the GPU node's: set it from the downward API's spec.nodeName), else the hostname.
    {device} keys the slot per GPU: one name per GPU this process sees (CUDA_VISIBLE_DEVICES's
    entries; unset: every GPU of the host, "cpu" on a host without one), so that one gpu-1x worker
    per GPU (each started with its own CUDA_VISIBLE_DEVICES) runs one stage per GPU side by side,
    while a stage that sees all of them (a gpu-8x worker) takes every GPU's slot."""
    template = os.environ.get("EAGLE3_GPU_LIMIT", "").strip()
    if not template:
        return []
    host = os.environ.get("EAGLE3_NODE_NAME", "").strip() or socket.gethostname()
    devices = visible_devices() if "{device}" in template else [""]
    return [template.format(host=host, device=dev).lower() for dev in devices]


def visible_devices() -> list[str]:
    """The GPUs a stage of this process would use: CUDA_VISIBLE_DEVICES's entries, else all the host
    has."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()] or ["none"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] or ["cpu"]


@contextlib.contextmanager
def gpu_slot(stage: str, waited: dict[str, float] | None = None):
    """Hold this host's GPU slot(s) (strict: a missing limit is an error, never a silent
    free-for-all). The seconds spent waiting for them go to waited["slot_wait_s"].

    Not first-come-first-served: Prefect's global concurrency limits keep no queue; a waiter that
    gets 423 Locked sleeps the server's Retry-After and asks again, so after a release whichever
    waiter asks first wins (docs/operations.md, "The GPU slot", gives the arrival-order setup: a
    work pool concurrency limit, whose runs the server hands out oldest first)."""
    names = gpu_limit_names() if stage in SUBPROCESS_STAGES else []
    t0 = time.time()
    if not names:
        if waited is not None:
            waited["slot_wait_s"] = 0.0
        yield
        return
    from prefect.concurrency.sync import concurrency

    shown = ", ".join(repr(n) for n in names)
    get_run_logger().info("stage %s: waiting for GPU slot %s", stage, shown)
    with concurrency(names, occupy=1, strict=True, lease_duration=GPU_LEASE_S):
        wait_s = time.time() - t0
        if waited is not None:
            waited["slot_wait_s"] = round(wait_s, 2)
        get_run_logger().info("stage %s: got GPU slot %s after %.1f s", stage, shown, wait_s)
        yield


def call_library(
    stage: str, cfg: StageConfig, on_progress=None, waited: dict[str, float] | None = None
) -> dict[str, Any]:
    """Run the library function for `stage`, in a subprocess for GPU stages; return its result as
    JSON. The GPU slot wait goes to waited["slot_wait_s"] (not stage time)."""
    with gpu_slot(stage, waited):
        if runs_in_subprocess(stage):
            return run_stage_subprocess(
                stage,
                cfg.model_dump(mode="json"),
                log=get_run_logger(),
                on_progress=on_progress,
                probe=make_probe(stage, cfg),
            )
        return jsonable(run_stage_function(stage, cfg))


def execute_stage(
    stage: str, config: StageConfig | dict[str, Any], upstream: dict[str, Any], run_name: str
) -> dict[str, Any]:
    """The body of every stage task: prepare the output dir, call the library, stamp, report."""
    cfg = as_stage_config(stage, config)
    upstream = slim_upstream(upstream)
    out = Path(cfg.out)
    key = stage_cache_key(stage, cfg, upstream)
    ok, _ = verify_outputs(out, key)
    if ok:  # intact output of this very key (e.g. Prefect's result storage was wiped): adopt it
        stamp = read_stamp(out) or {}
        get_run_logger().info(
            "stage %s: %s already holds verified output of key %s; not re-running", stage, out, key
        )
        return {k: stamp.get(k) for k in MANIFEST_KEYS}
    action, resumed_from = start_output(stage, out, key)
    progress = artifacts.Progress(run_name, stage) if stage in PROGRESS_STAGES else None
    t0, waited = time.time(), {"slot_wait_s": 0.0}
    result = call_library(
        stage, cfg, on_progress=progress.update if progress else None, waited=waited
    )
    wall_s = time.time() - t0 - waited["slot_wait_s"]  # running time only: the wait is apart
    if progress:
        progress.update(1.0)
    files = list_outputs(out)
    manifest = {
        "stage": stage,
        "key": key,
        "out": str(out),
        "content_sha256": content_sha256(files),
        "num_files": len(files),
        "num_bytes": sum(v[0] for v in files.values()),
        "wall_s": round(wall_s, 2),
        "slot_wait_s": waited["slot_wait_s"],
        "resumed_from": resumed_from,
        "result": result,
    }
    finished = {"status": "done", "files": files, "upstream": upstream, "config": config_dict(cfg)}
    write_stamp(out, {**manifest, **finished, "finished_at": time.time()})
    report_stage(run_name, manifest, action)
    return manifest


def start_output(stage: str, out: Path, key: str) -> tuple[str, str | None]:
    """Prepare the output dir for a run of `key` (wiped, or kept to resume) and stamp it running;
    returns what was done and, when it resumes, from where."""
    action = prepare_out_dir(stage, out, key)
    resumes = action.startswith(("resuming", "damaged"))
    resumed_from = describe_resume_point(stage, out) if resumes else None
    get_run_logger().info(
        "stage %s: key %s, output %s (%s%s)",
        stage,
        key,
        out,
        action,
        f": from {resumed_from}" if resumed_from else "",
    )
    write_stamp(out, {"stage": stage, "key": key, "status": "running", "started_at": time.time()})
    return action, resumed_from


def report_stage(run_name: str, manifest: dict[str, Any], action: str) -> None:
    """The stage's summary artifact, and the artifacts of train, export and evaluate."""
    stage, out, result = manifest["stage"], Path(manifest["out"]), manifest["result"]
    artifacts.stage_summary(run_name, manifest, action)
    if stage == "train":
        artifacts.train_metrics(run_name, out)
    elif stage == "export":
        artifacts.exported_draft(run_name, out)
    elif stage == "evaluate":
        artifacts.evaluate_result(run_name, out, result if isinstance(result, dict) else {})


def _stage_task(stage: str):
    def body(config: Any, upstream: dict[str, Any], run_name: str = "eagle3") -> dict[str, Any]:
        return execute_stage(stage, config, upstream, run_name)

    body.__name__ = f"{stage}_task"
    body.__doc__ = f"Stage {stage}: call eagle3's run_{stage} and return its manifest."
    return task(
        body,
        name=stage,
        task_run_name=stage,
        cache_policy=StageCachePolicy(stage=stage),
        persist_result=True,
        result_serializer="json",
        retries=NUM_RETRIES,
        retry_delay_seconds=exponential_backoff(backoff_factor=RETRY_BASE_S)
        if RETRY_BASE_S > 0
        else 0,
        retry_jitter_factor=0.2 if RETRY_BASE_S > 0 else None,
        retry_condition_fn=retry_transient_only,
        # in-process libraries print progress noise; GPU stages stream via the logger
        log_prints=False,
    )


#: one task per stage that a flow runs (the streaming sides run in flows/streaming.py's
#: `stream-side` task)
STAGE_TASKS = {name: _stage_task(name) for name, s in STAGES.items() if s.kind != "stream"}


def run_stage(
    stage: str,
    config: StageConfig,
    upstream: dict[str, dict[str, Any]] | None = None,
    *,
    run_name: str = "eagle3",
    deployment: str | None = None,
    gpu_limit: str | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run one stage through its task (or, with `deployment`, as a run of that deployment on its
    work pool), honouring a cache hit only when the stamped outputs still verify. The returned
    manifest has `cached: true` when the stage did not execute. cache_dir: where the cache records
    go (result_storage)."""
    upstream = slim_upstream(upstream or {})
    key = stage_cache_key(stage, config, upstream)
    ok, reason = verify_outputs(config.out, key)
    if deployment:
        from eagle3_prefect.tasks.dispatch import dispatch_stage

        t = dispatch_stage.with_options(
            cache_policy=StageCachePolicy(stage=stage),
            name=f"dispatch-{stage}",
            # "capture on gpu-1x": the stage and the pool its run went to
            task_run_name=f"{stage} on {deployment.rsplit(' · ', 1)[-1]}",
        )
        args: tuple = (
            stage,
            config.model_dump(mode="json"),
            upstream,
            run_name,
            deployment,
            gpu_limit,
            str(Path(cache_dir).resolve()) if cache_dir else None,
        )
    else:
        t, args = STAGE_TASKS[stage], (config, upstream, run_name)
    storage = result_storage(cache_dir)
    if storage is not None:
        t = t.with_options(result_storage=storage)
    if not ok:
        get_run_logger().info("stage %s: no reusable cached result (%s)", stage, reason)
        t = t.with_options(refresh_cache=True)
    state = t(*args, return_state=True)
    manifest = dict(state.result())  # raises the stage's error when it failed
    manifest["cached"] = state.name == "Cached"
    if deployment:
        manifest["deployment"] = deployment
    return manifest
