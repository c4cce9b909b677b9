"""Launch a stage as a run of its own deployment (on a hardware-tagged work pool) from the parent flow.

`run_deployment` is wrapped in a task so that the parent's cancellation reaches the child (it runs as a
subflow) and a cached, verified stage never even schedules a GPU run.

A lost host. When the machine running a GPU stage dies (power, kernel panic, a preempted spot instance), nobody is
left to report the child flow run's state: it stays Running forever and the parent would wait forever. So the
GPU stage flows write a heartbeat into the stage's out dir (`heartbeat`, every EAGLE3_HEARTBEAT_S) and the parent
watches it: a Running child whose heartbeat has not changed for EAGLE3_LOST_AFTER_S is marked Crashed, with
what was last heard from it, and dispatched again (EAGLE3_NUM_REDISPATCHES times at most, as is a child that ends
Crashed on its own, e.g. its process was OOM-killed). The new run resumes: the stage's stamp says "unfinished"
and capture/train continue from their shards/checkpoints (tasks/manifest.prepare_out_dir). The heartbeat is a file
because the parent already relies on the work dir being visible to every pool (it reads the child's stamp); the
parent compares it with its last read, in its own clock, so no two hosts' clocks are compared. A child that
*failed* (the stage raised) is not dispatched again: its own task already retried what was transient.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Crashed

from eagle3.io import write_json
from eagle3_prefect.tasks.errors import StageCrashed, StageError
from eagle3_prefect.tasks.manifest import MANIFEST_KEYS, read_stamp

#: how often the parent polls the child flow run (EAGLE3_DISPATCH_POLL_S: the server tests poll faster)
POLL_INTERVAL_S = float(os.environ.get("EAGLE3_DISPATCH_POLL_S", "3"))
HEARTBEAT_FILE = ".eagle3-heartbeat.json"  # a dot-file: never part of the stage's outputs (tasks/manifest.py)
#: the child writes its heartbeat this often; the parent passes min(this, LOST_AFTER_S / 4) to its children
HEARTBEAT_S = float(os.environ.get("EAGLE3_HEARTBEAT_S", "30"))
#: a Running child silent this long is lost
LOST_AFTER_S = float(os.environ.get("EAGLE3_LOST_AFTER_S", "600"))
#: new runs of a stage whose run crashed or was lost
NUM_REDISPATCHES = int(os.environ.get("EAGLE3_NUM_REDISPATCHES", "2"))


@contextlib.contextmanager
def heartbeat(out: str | Path | None, interval_s: float | None = None) -> Iterator[Path | None]:
    """While the block runs, rewrite `<out>/.eagle3-heartbeat.json` (flow run id, host, pid, a counter) every
    `interval_s` from a daemon thread, so the parent can tell a live child from one whose host is gone."""
    from prefect.context import FlowRunContext

    if out is None:  # nowhere to write (a config the stage itself refuses): nothing to watch either
        yield None
        return
    interval_s = float(os.environ.get("EAGLE3_HEARTBEAT_S", HEARTBEAT_S)) if interval_s is None else interval_s
    ctx = FlowRunContext.get()
    path = Path(out) / HEARTBEAT_FILE
    me = {"flow_run_id": str(ctx.flow_run.id) if ctx and ctx.flow_run else None, "host": socket.gethostname(),
          "pid": os.getpid(), "interval_s": interval_s}
    stop = threading.Event()

    def beat() -> None:
        num_beats = num_failed = 0
        while True:
            num_beats += 1
            try:  # the stage may wipe its out dir at start (tasks/manifest.prepare_out_dir): the next beat rewrites
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, {**me, "num_beats": num_beats, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            except OSError as e:  # said once; a beat that never lands shows in the parent as a lost run
                if num_failed == 0:
                    logging.getLogger("eagle3.heartbeat").warning("cannot write the heartbeat %s: %s", path, e)
                num_failed += 1
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=beat, name="eagle3-heartbeat", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(timeout=5)


def child_env(gpu_limit: str | None = None) -> dict[str, str]:
    """Environment for a dispatched child: a heartbeat interval the parent's LOST_AFTER_S can rely on, and the GPU
    limit's name when it is overridden."""
    env = {"EAGLE3_HEARTBEAT_S": f"{min(HEARTBEAT_S, LOST_AFTER_S / 4):g}"}
    if gpu_limit:
        env["EAGLE3_GPU_LIMIT"] = gpu_limit
    return env


def read_heartbeat(out: str | Path | None) -> dict[str, Any] | None:
    if out is None:
        return None
    try:
        return json.loads((Path(out) / HEARTBEAT_FILE).read_text())
    except (OSError, ValueError):
        return None


def wait_for(flow_run: Any, name: str, out: str | Path | None, lost_after_s: float = LOST_AFTER_S) -> Any:
    """Give the child's placeholder task run in the parent (run_deployment names it with random words) a
    real name, then wait for the child to reach a final state; returns the final flow run. A Running child whose
    heartbeat stalls for `lost_after_s` is set Crashed here (nobody else will)."""
    with get_client(sync_client=True) as client:
        if flow_run.parent_task_run_id:
            try:
                client.set_task_run_name(flow_run.parent_task_run_id, name)
            except Exception as e:  # noqa: BLE001 - a cosmetic name must not fail a GPU stage; say so
                get_run_logger().warning("could not name the placeholder task run of %s: %s", name, e)
        last_beat, last_change = None, time.monotonic()
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            state, now = flow_run.state, time.monotonic()
            if state is not None and state.is_final():
                return flow_run
            if state is None or not state.is_running():  # scheduled/pending: waiting for a worker is no loss
                last_change = now
            else:
                beat = read_heartbeat(out)
                if beat is not None and beat.get("flow_run_id") == str(flow_run.id) and beat != last_beat:
                    last_beat, last_change = beat, now
                elif out is not None and now - last_change > lost_after_s:
                    heard = (f"its last heartbeat (#{last_beat['num_beats']} from pid {last_beat['pid']} on host "
                             f"{last_beat['host']}, written {last_beat['time']})" if last_beat else "no heartbeat at all")
                    msg = (f"lost: Running, but {heard} and nothing for {now - last_change:.0f} s "
                           f"(EAGLE3_LOST_AFTER_S={lost_after_s:g}): its host or process is gone")
                    client.set_flow_run_state(flow_run.id, Crashed(message=msg), force=True)
                    return client.read_flow_run(flow_run.id)
            time.sleep(POLL_INTERVAL_S)


@task(name="dispatch-stage", persist_result=True, result_serializer="json", retries=0)
def dispatch_stage(stage: str, config: dict[str, Any], upstream: dict[str, Any], run_name: str,
                   deployment: str, gpu_limit: str | None = None) -> dict[str, Any]:
    """Run `stage` as a flow run of `deployment` and return the manifest its task stamped; a run that crashed or
    whose host was lost is dispatched again (it resumes). gpu_limit overrides the deployment's EAGLE3_GPU_LIMIT
    (HardwareProfile.gpu_concurrency_limit)."""
    logger = get_run_logger()
    env = child_env(gpu_limit)
    for attempt in range(NUM_REDISPATCHES + 1):
        logger.info("stage %s: dispatching to deployment %s%s", stage, deployment,
                    f" (again: {attempt} of {NUM_REDISPATCHES})" if attempt else "")
        flow_run = run_deployment(
            name=deployment,
            parameters={"config": config, "upstream": upstream, "run_name": run_name},
            flow_run_name=f"{run_name}-{stage}" + (f"-again{attempt}" if attempt else ""),
            timeout=0,  # returns once created: name its placeholder task run, then wait below
            as_subflow=True,
            job_variables={"env": env},
        )
        flow_run = wait_for(flow_run, f"{stage} on {deployment}" + (f" (again {attempt})" if attempt else ""),
                            config["out"])
        state = flow_run.state
        if state is not None and state.is_completed():
            break
        how = f"{state.name if state else 'without a state'}: {state.message if state else ''}"
        if state is not None and state.is_failed():  # the child ran and failed (it already retried)
            raise StageError(stage, f"deployment run {flow_run.name} ({flow_run.id}) failed: {how}")
        if state is None or not state.is_crashed() or attempt == NUM_REDISPATCHES:
            raise StageCrashed(stage, f"deployment run {flow_run.name} ({flow_run.id}) ended {how}"
                                      + (f" (after {attempt} more runs)" if attempt else ""))
        logger.warning("stage %s: deployment run %s ended %s; dispatching it again", stage, flow_run.name, how)
    stamp = read_stamp(config["out"])
    if not stamp or stamp.get("status") != "done":
        raise StageError(stage, f"deployment run {flow_run.name} completed but {config['out']} holds no finished "
                                "stamp: is the work dir on storage both pools can see?")
    return {k: stamp.get(k) for k in MANIFEST_KEYS}
