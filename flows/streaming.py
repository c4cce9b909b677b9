"""Streaming (bounded-disk) mode as a Prefect flow: the producer (stream-capture) and the consumer
(stream-train) run concurrently, each as its own task, and meet only through the spool directory.

    from eagle3_prefect.flows.streaming import streaming; streaming(load_pipeline_config("my.yaml"))

By default both sides run as subprocesses of this flow run
(`python -m eagle3_prefect.tasks._stage_main`, like the GPU stages). With `capture_deployment` /
`train_deployment` (e.g. "eagle3-stream-capture/subflow · stream-capture · gpu-1x",
"eagle3-stream-train/subflow · stream-train · gpu-1x", prefect.yaml) a side runs as a run of that
deployment: the spool must then be on storage both hosts see. Each side resumes by itself, so a
crashed side is retried.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.deployments import run_deployment
from prefect.tasks import exponential_backoff

from eagle3.config import PipelineConfig, StreamCaptureConfig, StreamTrainConfig
from eagle3.stages import STAGES, stage_names
from eagle3_prefect.flows.report import run_namer
from eagle3_prefect.tasks.errors import StageCrashed, retry_transient_only
from eagle3_prefect.tasks.stages import NUM_RETRIES, RETRY_BASE_S, as_stage_config
from eagle3_prefect.tasks.subprocess_runner import run_stage_subprocess

#: the stream variants of the stage declaration (eagle3.stage_graph): producer, consumer
SIDES = stage_names("stream")


def call_side(stage: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run one side's library function: in a subprocess, or here when EAGLE3_INPROCESS names it
    (tests)."""
    from eagle3.stages import jsonable, run_stage_function
    from eagle3_prefect.tasks.stages import runs_in_subprocess

    cfg = as_stage_config(stage, config)
    if runs_in_subprocess(STAGES[stage].variant_of):  # as the stage it stands for
        return run_stage_subprocess(stage, cfg.model_dump(mode="json"), log=get_run_logger())
    return jsonable(run_stage_function(stage, cfg))


@task(
    name="stream-side",
    task_run_name="{stage}",
    retries=NUM_RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=RETRY_BASE_S) if RETRY_BASE_S > 0 else 0,
    retry_condition_fn=retry_transient_only,
)
def stream_side(
    stage: str, config: dict[str, Any], deployment: str | None = None
) -> dict[str, Any]:
    """One side of streaming mode, here or as a run of `deployment`; returns the side's result."""
    if not deployment:
        return call_side(stage, config)
    get_run_logger().info("%s: dispatching to deployment %s", stage, deployment)
    from eagle3_prefect.tasks.dispatch import close_task_runs, wait_for

    run = wait_for(
        run_deployment(name=deployment, parameters={"config": config}, as_subflow=True, timeout=0),
        f"{stage} on {deployment}",
    )
    if (
        run.state is None or not run.state.is_completed()
    ):  # a crashed or lost side is retried by this task
        how = f"{run.state.name}: {run.state.message}" if run.state else "without a state"
        if run.state is not None and run.state.is_crashed():
            close_task_runs(run.id, f"its flow run {run.name} crashed: {run.state.message}")
        raise StageCrashed(stage, f"deployment run {run.name} ended {how}")
    return {"deployment": deployment, "flow_run": str(run.id)}


@flow(name="eagle3-stream", log_prints=True, flow_run_name=run_namer("streaming"))
def streaming(
    config: PipelineConfig,
    capture_deployment: str | None = None,
    train_deployment: str | None = None,
) -> dict[str, Any]:
    """Capture and train concurrently through the capped spool (prepare and vocab must have run);
    returns {"stream-capture": result, "stream-train": result}."""
    deployments = (capture_deployment, train_deployment)
    futures = {
        side: stream_side.submit(side, cfg.model_dump(mode="json"), deployment)
        for side, cfg, deployment in zip(SIDES, config.stream_stages(), deployments, strict=True)
    }
    return {side: f.result() for side, f in futures.items()}


@flow(name="eagle3-stream-capture", log_prints=True)
def stream_capture_stage(config: StreamCaptureConfig) -> dict[str, Any]:
    """The producer on its own work pool (deployed in prefect.yaml)."""
    return call_side("stream-capture", config.model_dump(mode="json"))


@flow(name="eagle3-stream-train", log_prints=True)
def stream_train_stage(config: StreamTrainConfig) -> dict[str, Any]:
    """The consumer on its own work pool (deployed in prefect.yaml)."""
    return call_side("stream-train", config.model_dump(mode="json"))
