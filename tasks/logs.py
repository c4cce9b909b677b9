"""One error, one ERROR record: a filter on Prefect's run loggers for failures whose message is the
diagnosis.

Without it one config error fills a run's log with three ERROR records and two 20-30 line
tracebacks: the task engine's "Task run failed with exception", the flow engine's "Encountered
exception during execution" and the entrypoint's "Engine execution exited with unexpected exception"
(plus "Finished in state Failed" at ERROR). For an exception `is_user_error` accepts
(tasks/errors.py) the filter keeps the first record of it in each flow run at ERROR as `<type>:
<message>` and moves its traceback to a DEBUG record; the repeats of the same error in that run go
to DEBUG, and a "Finished in state Failed(...)" that only restates it goes to INFO. A bug (any other
exception) keeps Prefect's records and tracebacks as they are.
"""

from __future__ import annotations

import collections
import logging
import threading

from eagle3_prefect.tasks.errors import is_user_error

#: the loggers Prefect's engines log run failures on
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")
#: records that only repeat a failure the run already reported (the entrypoint's wrappers)
_REPEATS = ("Engine execution exited", "Execution of flow run", "Execution exited")


class OneErrorRecord(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._seen: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)
        self._guard = threading.Lock()
        self._emitting = threading.local()

    def _run_id(self, record: logging.LogRecord) -> str:
        run = getattr(record, "flow_run_id", None)
        if run is None:
            try:
                from prefect.context import FlowRunContext

                ctx = FlowRunContext.get()
                run = ctx.flow_run.id if ctx and ctx.flow_run else None
            except Exception:  # no context: one key for the process
                run = None
        return str(run)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._emitting, "on", False):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_user_error(exc):
            text = str(exc)
            key = (self._run_id(record), text)
            with self._guard:
                first = key not in self._seen and not record.getMessage().startswith(_REPEATS)
                if first:
                    self._seen.append(key)
            if not first:  # a DEBUG record: only where DEBUG records are wanted
                _demote(record, logging.DEBUG)
                return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
            exc_info = record.exc_info
            record.msg, record.args = f"{type(exc).__name__}: {text}", ()
            record.exc_info, record.exc_text = None, None
            self._emitting.on = True
            try:  # the traceback, for whoever runs at DEBUG
                logging.getLogger(record.name).debug(
                    "traceback of the error above",
                    exc_info=exc_info,
                    extra={
                        k: getattr(record, k)
                        for k in ("flow_run_id", "task_run_id")
                        if hasattr(record, k)
                    },
                )
            finally:
                self._emitting.on = False
            return True
        if record.levelno >= logging.ERROR and record.exc_info is None:
            message = record.getMessage()
            if message.startswith("Finished in state"):
                run = self._run_id(record)
                with self._guard:
                    restates = any(r == run and _probe(t) in message for r, t in self._seen)
                if restates:
                    _demote(record, logging.INFO)
        return True


def _probe(text: str) -> str:
    """A piece of the error's text that survives the repr() in "Finished in state Failed('...')":
    its first line up to any quote or backslash (repr escapes those)."""
    line = text.splitlines()[0] if text else ""
    for i, ch in enumerate(line):
        if ch in "'\"\\":
            line = line[:i]
            break
    return line[:60] or "\0"


def _demote(record: logging.LogRecord, level: int) -> None:
    record.levelno, record.levelname = level, logging.getLevelName(level)


_FILTER = OneErrorRecord()


def install() -> None:
    """Put the filter on Prefect's run loggers (once per process; idempotent)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
