"""`prefect worker start` that stops when told to: python -m eagle3_prefect.flows.worker --pool cpu
--type process

Prefect's worker turns its first SIGTERM into a SIGINT to itself and waits for that to end it.
Started in the background of a script (`... &`) a process has SIGINT ignored, so that SIGINT does
nothing and the worker runs on until a second SIGTERM (SIGKILL); started in the foreground its
shutdown still took 8+ s. This entry point gives SIGINT its default handler back and bounds the
shutdown: SIGTERM (or SIGINT) stops the worker gracefully, and if it is still there after
EAGLE3_WORKER_STOP_S (default 3 s) it exits anyway. Flow runs it started are processes of their own
and go on (Prefect's behaviour); every argument is `prefect worker start`'s.
"""

from __future__ import annotations

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


def main(argv: list[str] | None = None) -> None:
    import prefect.utilities.processutils as processutils
    from prefect.cli import app

    processutils.setup_signal_handlers_worker = (
        install_stop_handlers  # the CLI imports it when it starts
    )
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # a `&` in a script starts us with SIGINT ignored
    sys.argv = ["prefect", "worker", "start", *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
