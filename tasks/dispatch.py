"""Launch a stage as a run of its own deployment (on a hardware-tagged work pool) from the parent flow.

`run_deployment` is wrapped in a task so that the parent's cancellation reaches the child (it runs as a
subflow) and a cached, verified stage never even schedules a GPU run.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from eagle3_prefect.tasks.errors import StageCrashed, StageError
from eagle3_prefect.tasks.manifest import MANIFEST_KEYS, read_stamp

#: how often the parent polls the child flow run
POLL_INTERVAL_S = 3.0


def wait_named(flow_run: Any, name: str) -> Any:
    """Give the child's placeholder task run in the parent (run_deployment names it with random words) a
    real name, then wait for the child to reach a final state; returns the final flow run."""
    with get_client(sync_client=True) as client:
        if flow_run.parent_task_run_id:
            try:
                client.set_task_run_name(flow_run.parent_task_run_id, name)
            except Exception as e:  # noqa: BLE001 - a cosmetic name must not fail a GPU stage; say so
                get_run_logger().warning("could not name the placeholder task run of %s: %s", name, e)
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            time.sleep(POLL_INTERVAL_S)


@task(name="dispatch-stage", persist_result=True, result_serializer="json", retries=0)
def dispatch_stage(stage: str, config: dict[str, Any], upstream: dict[str, Any], run_name: str,
                   deployment: str, gpu_limit: str | None = None) -> dict[str, Any]:
    """Run `stage` as a flow run of `deployment` and return the manifest its task stamped.
    gpu_limit overrides the deployment's EAGLE3_GPU_LIMIT (HardwareProfile.gpu_concurrency_limit)."""
    logger = get_run_logger()
    logger.info("stage %s: dispatching to deployment %s", stage, deployment)
    flow_run = run_deployment(
        name=deployment,
        parameters={"config": config, "upstream": upstream, "run_name": run_name},
        flow_run_name=f"{run_name}-{stage}",
        timeout=0,  # returns once created: name its placeholder task run, then wait below
        as_subflow=True,
        job_variables={"env": {"EAGLE3_GPU_LIMIT": gpu_limit}} if gpu_limit else None,
    )
    flow_run = wait_named(flow_run, f"{stage} on {deployment}")
    state = flow_run.state
    if state is None or not state.is_completed():
        how = f"{state.name if state else 'without a state'}: {state.message if state else ''}"
        if state is not None and state.is_failed():  # the child ran and failed (it already retried)
            raise StageError(stage, f"deployment run {flow_run.name} ({flow_run.id}) failed: {how}")
        raise StageCrashed(stage, f"deployment run {flow_run.name} ({flow_run.id}) ended {how}")
    stamp = read_stamp(config["out"])
    if not stamp or stamp.get("status") != "done":
        raise StageError(stage, f"deployment run {flow_run.name} completed but {config['out']} holds no finished "
                                "stamp: is the work dir on storage both pools can see?")
    return {k: stamp.get(k) for k in MANIFEST_KEYS}
