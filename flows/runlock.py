"""One pipeline per work dir, named by its flow run: `work_dir_lock` wraps the library's
`eagle3.lock.dir_lock` with the holder's flow run (name, id, UI link) so that a second run's error,
its alert and the UI say which run holds the work dir, and closes the run a lost holder left behind.

A holder whose process died (SIGKILL, OOM, a lost host) frees the flock with its process. The next
run takes the lock over and reads from the lock file which flow run held it: if the server still
shows that run Running (the automation eagle3-run-lost has not marked it yet), it is set Crashed
here, and the task runs it left Running are closed. What the next run resumes from is in its summary
(`takeover`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.states import Crashed

from eagle3.lock import describe_holder, dir_lock
from eagle3_prefect.tasks.dispatch import close_task_runs, run_seconds


def flow_run_holder() -> dict[str, str | None]:
    """The current flow run as the lock file records it (empty outside a flow run)."""
    from prefect.runtime import flow_run

    if not flow_run.id:
        return {}
    return {
        "flow_run_name": flow_run.name,
        "flow_run_id": str(flow_run.id),
        "flow_run_url": flow_run.ui_url,
    }


def close_stale_run(old: dict[str, Any]) -> dict[str, Any]:
    """The lost holder's flow run: set Crashed if it is still not final, its leftover task runs
    closed; returns what the summary reports (name, id, state, message, seconds it ran, closed task
    runs)."""
    from prefect.client.orchestration import get_client

    me = flow_run_holder()
    info: dict[str, Any] = {
        "holder": describe_holder(old),
        "flow_run": old.get("flow_run_name"),
        "flow_run_id": old.get("flow_run_id"),
    }
    if not old.get("flow_run_id") or old.get("flow_run_id") == me.get("flow_run_id"):
        return info
    log = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(old["flow_run_id"])
            if fr.state is not None and not fr.state.is_final():
                process = {k: v for k, v in old.items() if "flow_run" not in k}
                msg = (
                    f"lost: its process ({describe_holder(process)}) ended without a final state; "
                    f"flow run {me.get('flow_run_name')!r} found its work dir lock free and "
                    "took it over"
                )
                client.set_flow_run_state(fr.id, Crashed(message=msg), force=True)
                fr = client.read_flow_run(fr.id)
        info.update(
            state=fr.state.name if fr.state else None,
            message=fr.state.message if fr.state else "",
            wall_s=run_seconds(fr),
        )
        info["closed_task_runs"] = close_task_runs(
            fr.id, f"its flow run {fr.name} crashed: {info['message']}"
        )
    except Exception as e:  # the lock is ours either way; say why the run stays open
        log.warning(
            "took over the work dir lock of flow run %s but could not close that run: %s",
            old.get("flow_run_name"),
            e,
        )
        return info
    log.warning(
        "took over the work dir lock of lost flow run %s (%s, %s s): %s",
        info["flow_run"],
        info["state"],
        info["wall_s"],
        info["message"],
    )
    return info


@contextlib.contextmanager
def work_dir_lock(work_dir: str | Path, what: str) -> Iterator[dict[str, Any]]:
    """Hold <work_dir>/.eagle3.lock for the flow run; yields {} or, after a lost holder, what
    close_stale_run found (the summary reports it)."""
    takeover: dict[str, Any] = {}
    with dir_lock(
        work_dir,
        what,
        holder=flow_run_holder(),
        on_stale=lambda old: takeover.update(close_stale_run(old)),
    ):
        yield takeover
