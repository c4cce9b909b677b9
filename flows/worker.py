"""`prefect worker start` that stops when told to:

    python -m eagle3_prefect.flows.worker --pool cpu --type process

Prefect's worker turns its first SIGTERM into a SIGINT to itself and waits for that to end it.
Started in the background of a script (`... &`) a process has SIGINT ignored, so that SIGINT does
nothing and the worker runs on until a second SIGTERM (SIGKILL); started in the foreground its
shutdown still took 8+ s. This entry point gives SIGINT its default handler back and bounds the
shutdown: SIGTERM (or SIGINT) stops the worker gracefully, and if it is still there after
EAGLE3_WORKER_STOP_S (default 3 s) it exits anyway. Flow runs it started are processes of their own
and go on (Prefect's behaviour); every argument is `prefect worker start`'s.

It also keeps a failed run's log to one ERROR record: a flow run that reported Failed itself (a
config error: tasks/logs.py) leaves its process with status 1, which the worker logged as a second
ERROR ("Process for flow run ... exited with status code: 1"); here that line is INFO when the run's
state is already Failed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

STOP_S = float(os.environ.get("EAGLE3_WORKER_STOP_S", "3"))


def _stop(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    print(f"eagle3 worker: {name}: stopping (at most {STOP_S:g} s)", file=sys.stderr, flush=True)
    timer = threading.Timer(STOP_S, lambda: os._exit(128 + signum))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt  # the worker's graceful path


def install_stop_handlers(*_args, **_kwargs) -> None:
    """Stand-in for prefect's setup_signal_handlers_worker: SIGTERM and SIGINT stop the worker (see
    above)."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)


class FailedRunExitIsInfo(logging.Filter):
    """The worker's "exited with status code: 1" of a run whose own state is Failed is INFO (the
    run's log already has its error); WARNING when the state cannot be read."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "exited with status code: 1;" in record.getMessage():
            run_id = getattr(record, "flow_run_id", None)
            level = logging.WARNING
            try:
                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as client:
                    state = client.read_flow_run(run_id).state
                if state is not None and state.is_failed():
                    level = logging.INFO
            except Exception as e:  # a log level is never worth failing the worker
                print(
                    f"eagle3 worker: cannot read the state of flow run {run_id}: {e!r}",
                    file=sys.stderr,
                    flush=True,
                )
            record.levelno, record.levelname = level, logging.getLevelName(level)
        return True


def main(argv: list[str] | None = None) -> None:
    import prefect.utilities.processutils as processutils
    from prefect.cli import app

    processutils.setup_signal_handlers_worker = install_stop_handlers  # the CLI imports it later
    signal.signal(signal.SIGINT, signal.default_int_handler)  # `&` in a script: SIGINT is ignored
    logging.getLogger("prefect.flow_runs.runner").addFilter(FailedRunExitIsInfo())
    sys.argv = ["prefect", "worker", "start", *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
