"""Launch a stage as a run of its own deployment (on a hardware-tagged work pool) from the parent
flow.

`run_deployment` is wrapped in a task so that the parent's cancellation reaches the child (it runs
as a subflow) and a cached, verified stage never even schedules a GPU run.

A lost host. When the machine running a GPU stage dies (power, kernel panic, a preempted spot
instance), nobody is left to report the child flow run's state. Prefect's flow-run heartbeats report
it instead: every eagle3 run sends one every 30 s, and the server's automation `eagle3-run-lost`
(blocks/alerts.py) sets a Running run that misses them for EAGLE3_LOST_AFTER_S (60 s) Crashed, which
alerts. Here the parent sees the child end Crashed (lost, or killed on its own, e.g. OOM), closes
the task runs the dead process left Running, and dispatches the stage again (EAGLE3_NUM_REDISPATCHES
times at most). The new run resumes: the stage's stamp says "unfinished" and capture/train continue
from their shards/checkpoints (tasks/manifest.prepare_out_dir). Every attempt is kept in the stage's
manifest (`attempts`: run, state, time lost, what the next run resumed from), so the pipeline's
summary says what happened. A child that *failed* (the stage raised) is not dispatched again: its
own task already retried what was transient.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as runtime_flow_run
from prefect.states import Crashed

from eagle3_prefect.tasks.errors import StageCrashed, StageError, StageRunFailed
from eagle3_prefect.tasks.manifest import MANIFEST_KEYS, describe_resume_point, read_stamp

#: how often the parent polls the child flow run (EAGLE3_DISPATCH_POLL_S: the server tests poll
#: faster)
POLL_INTERVAL_S = float(os.environ.get("EAGLE3_DISPATCH_POLL_S", "3"))
#: new runs of a stage whose run crashed or was lost
NUM_REDISPATCHES = int(os.environ.get("EAGLE3_NUM_REDISPATCHES", "2"))
#: the separator in run names: "demo · 2026-12-04 23:18", a stage run "demo · 2026-12-04 23:18 ›
#: capture"
CHILD_SEP = " › "


def child_run_name(parent: str | None, run_name: str, stage: str, attempt: int = 0) -> str:
    """The name of a stage run the pipeline launches on a GPU pool: the parent run's name, then the
    stage, e.g. "demo · 2026-12-04 23:18 › capture" (a sweep branch's artifact prefix
    "demo-layers-1-2-3" adds "layers-1-2-3"). Without a parent run (a script): "<run_name>-<stage>".
    """
    again = f" (again {attempt})" if attempt else ""
    if not parent:
        return f"{run_name}-{stage}" + (f"-again{attempt}" if attempt else "")
    head = parent.split(" · ")[0]
    branch = run_name.removeprefix(head).strip("-") if run_name != head else ""
    return CHILD_SEP.join(p for p in (parent, branch, stage) if p) + again


def child_env(gpu_limit: str | None = None) -> dict[str, str]:
    """Environment for a dispatched child: the GPU limit's name when it is overridden."""
    return {"EAGLE3_GPU_LIMIT": gpu_limit} if gpu_limit else {}


def close_task_runs(flow_run_id: Any, message: str) -> list[str]:
    """Set the task runs of a flow run that its dead process left Running (or Pending) Crashed;
    returns their names. A crashed run's tasks never report an end themselves."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    closed = []
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        for tr in runs:
            if tr.state is not None and not tr.state.is_final():
                client.set_task_run_state(tr.id, Crashed(message=message), force=True)
                closed.append(tr.name)
    return closed


def run_seconds(flow_run: Any) -> float | None:
    """Seconds from the run's start to its final state (the work a crashed run lost), when both are
    known."""
    start = getattr(flow_run, "start_time", None)
    end = flow_run.state.timestamp if flow_run.state is not None else None
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 1)


def wait_for(flow_run: Any, name: str) -> Any:
    """Give the child's placeholder task run in the parent (run_deployment names it with random
    words) a real name, then wait for the child to reach a final state; returns the final flow run.
    A child whose process or host is lost ends Crashed through the server's automation
    eagle3-run-lost (Prefect's heartbeats)."""
    with get_client(sync_client=True) as client:
        if flow_run.parent_task_run_id:
            try:
                client.set_task_run_name(flow_run.parent_task_run_id, name)
            # a cosmetic name must not fail a GPU stage; say so
            except Exception as e:
                get_run_logger().warning(
                    "could not name the placeholder task run of %s: %s", name, e
                )
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            time.sleep(POLL_INTERVAL_S)


def attempt_record(flow_run: Any, stage: str, out: str | Path) -> dict[str, Any]:
    """One dispatched run of a stage, as the summary reports it."""
    state = flow_run.state
    record = {
        "flow_run": flow_run.name,
        "flow_run_id": str(flow_run.id),
        "state": state.name if state else None,
        "message": (state.message or "") if state else "",
        "wall_s": run_seconds(flow_run),
    }
    if state is not None and state.is_crashed():
        record["resumes_from"] = describe_resume_point(stage, out)
    return record


@task(name="dispatch-stage", persist_result=True, result_serializer="json", retries=0)
def dispatch_stage(
    stage: str,
    config: dict[str, Any],
    upstream: dict[str, Any],
    run_name: str,
    deployment: str,
    gpu_limit: str | None = None,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Run `stage` as a flow run of `deployment` and return the manifest its task stamped, with
    `attempts` when a run crashed or was lost and was dispatched again (it resumes). gpu_limit
    overrides the deployment's EAGLE3_GPU_LIMIT (HardwareProfile.gpu_concurrency_limit); cache_dir
    is where the child keeps its task's cache records (the pipeline's work dir)."""
    parameters = {"config": config, "upstream": upstream, "run_name": run_name}
    if cache_dir:
        parameters["cache_dir"] = cache_dir
    attempts: list[dict[str, Any]] = []
    for attempt in range(NUM_REDISPATCHES + 1):
        flow_run = launch_attempt(stage, deployment, parameters, child_env(gpu_limit), attempt)
        attempts.append(attempt_record(flow_run, stage, config["out"]))
        if flow_run.state is not None and flow_run.state.is_completed():
            break
        end_lost_attempt(stage, flow_run, attempt)
        get_run_logger().warning(
            "stage %s: deployment run %s ended %s after %s s; dispatching it again, resuming "
            "from %s",
            stage,
            flow_run.name,
            how_it_ended(flow_run.state),
            attempts[-1]["wall_s"],
            attempts[-1]["resumes_from"],
        )
    return finished_manifest(stage, config["out"], flow_run, attempts)


def launch_attempt(
    stage: str, deployment: str, parameters: dict[str, Any], env: dict[str, str], attempt: int
) -> Any:
    """One run of `stage` on `deployment` (a subflow of this run), followed to its final state."""
    again = f" (again {attempt})" if attempt else ""
    get_run_logger().info(
        "stage %s: dispatching to deployment %s%s",
        stage,
        deployment,
        f" (again: {attempt} of {NUM_REDISPATCHES})" if attempt else "",
    )
    flow_run = run_deployment(
        name=deployment,
        parameters=dict(parameters),
        flow_run_name=child_run_name(runtime_flow_run.name, parameters["run_name"], stage, attempt),
        timeout=0,  # returns once created: name its placeholder task run, then wait below
        as_subflow=True,
        job_variables={"env": env},
    )
    return wait_for(flow_run, f"{stage} on {deployment}{again}")


def how_it_ended(state: Any) -> str:
    return f"{state.name if state else 'without a state'}: {state.message if state else ''}"


def end_lost_attempt(stage: str, flow_run: Any, attempt: int) -> None:
    """After a run that did not complete: close the task runs a crashed run left running; raise
    when it is not dispatched again (it failed, it ended without crashing, or it was the last
    attempt)."""
    state = flow_run.state
    how = how_it_ended(state)
    if state is not None and state.is_crashed():
        closed = close_task_runs(
            flow_run.id, f"its flow run {flow_run.name} crashed: {state.message}"
        )
        if closed:
            get_run_logger().info(
                "stage %s: closed the task run(s) %s that %s left running",
                stage,
                closed,
                flow_run.name,
            )
    if state is not None and state.is_failed():  # the child ran and failed (it already retried)
        raise StageRunFailed(stage, f"deployment run {flow_run.name} ({flow_run.id}) failed: {how}")
    if state is None or not state.is_crashed() or attempt == NUM_REDISPATCHES:
        raise StageCrashed(
            stage,
            f"deployment run {flow_run.name} ({flow_run.id}) ended {how}"
            + (f" (after {attempt} more runs)" if attempt else ""),
        )


def finished_manifest(
    stage: str, out: str | Path, flow_run: Any, attempts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest the completed run stamped in `out`, with its `attempts` when there were
    several."""
    stamp = read_stamp(out)
    if not stamp or stamp.get("status") != "done":
        raise StageError(
            stage,
            f"deployment run {flow_run.name} completed but {out} holds no finished "
            "stamp: is the work dir on storage both pools can see?",
        )
    manifest = {k: stamp.get(k) for k in MANIFEST_KEYS}
    if len(attempts) > 1:
        manifest["attempts"] = attempts
    return manifest
