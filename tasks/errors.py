"""Error classes the tasks raise, and the retry rule: transient failures retry, deterministic ones
don't."""

from __future__ import annotations

import errno
from typing import Any


class StageError(RuntimeError):
    """A stage failed. `kind` is one of: config, oom, crash, engine_start, timeout."""

    kind = "crash"

    def __init__(self, stage: str, message: str):
        super().__init__(f"stage {stage}: {message}")
        self.stage = stage


class StageConfigError(StageError, ValueError):
    """The stage rejected its configuration or input data; rerunning cannot help."""

    kind = "config"


class StageOOMError(StageError):
    """Out of memory at a fixed batch size; rerunning cannot help (lower the batch/token size)."""

    kind = "oom"


class StageCrashed(StageError):
    """The stage process died (signal, non-zero exit without a classified error). Transient."""

    kind = "crash"


class EngineStartError(StageError):
    """The inference engine failed to start (port/IPC/driver hiccup). Transient."""

    kind = "engine_start"


class StageTimeout(StageError):
    """The stage exceeded its timeout_s and its process group was killed."""

    kind = "timeout"


class StageRunFailed(StageError):
    """A stage's own flow run (a deployment run on a GPU pool) failed: its log holds the error and
    its traceback; the parent only reports it. Not retried here (the child's task already retried
    what was transient)."""

    kind = "child"


ERROR_CLASSES: dict[str, type[StageError]] = {
    c.kind: c
    for c in (StageConfigError, StageOOMError, StageCrashed, EngineStartError, StageTimeout)
}

#: failures worth another attempt
TRANSIENT_KINDS = {"crash", "engine_start"}

_OOM_MARKERS = (
    "out of memory",
    "outofmemoryerror",
    "cuda error: out of memory",
    "cannot allocate memory",
)
_ENGINE_MARKERS = (
    "engine core initialization failed",
    "failed to start the engine",
    "enginedeaderror",
    "engine process failed to start",
)


def classify_exception(exc: BaseException) -> str:
    """Map an exception raised by a library stage function to a StageError kind."""
    if isinstance(exc, StageError):
        return exc.kind
    from eagle3.errors import UserError

    # a diagnosis (eagle3.errors): the same again until someone acts on it
    if isinstance(exc, UserError):
        return "config"
    name = type(exc).__name__.lower()
    text = f"{name}: {exc}".lower()
    if isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS):
        return "oom"
    if any(m in text for m in _ENGINE_MARKERS):
        return "engine_start"
    # another writer holds the out dir, the disk is full or read-only: the same again until someone
    # acts
    if type(exc).__name__ == "LockedError" or (
        isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    ):
        return "config"
    # ConfigError, pydantic ValidationError, TemplateError are ValueErrors; missing inputs are
    # FileNotFoundError; a KeyError/TypeError is a bug: none of them changes on a retry.
    if isinstance(
        exc,
        ValueError
        | LookupError
        | TypeError
        | FileNotFoundError
        | NotADirectoryError
        | PermissionError
        | NotImplementedError
        | AssertionError,
    ):
        return "config"
    return "crash"


#: StageError kinds whose message says all a person needs (what, where, the fix): no traceback at
#: ERROR level
USER_ERROR_KINDS = {"config", "oom", "timeout", "child"}


def is_user_error(exc: BaseException) -> bool:
    """A failure the message explains (a config or input error, a held lock, OOM at a fixed batch, a
    timeout, a failed child run): its traceback helps no one reading the run's log, so it is logged
    at DEBUG."""
    from pydantic import ValidationError

    from eagle3.config import ConfigError
    from eagle3.lock import LockedError

    if isinstance(exc, StageError):
        return exc.kind in USER_ERROR_KINDS
    return isinstance(exc, ConfigError | LockedError | ValidationError)


def is_transient(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    return classify_exception(exc) in TRANSIENT_KINDS


def retry_transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry crashes and engine start failures; never
    config/validation errors, OOM at a fixed batch size, or timeouts."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:  # the state's exception is what we classify
        return is_transient(exc)
    return False
