"""The one kind of failure a user is shown as a diagnosis instead of a traceback.

A stage raises `UserError` (or a subclass) at the boundary where the cause is known: the reader of a
file names the file, a config check names the field, a data check names the row, and each says the
fix. Its message is the whole diagnosis, one paragraph. The CLI prints it as ``eagle3 <command>:
error: <message>`` (the traceback only with ``-v``), the Prefect layer reports the same message, and
`eagle3.vllm_engine.run_in_subprocess` carries it back from a child process unchanged. Well-known
exception families that reach the top without passing such a boundary (an OSError with ENOSPC, a
SafetensorError, torch's writer failing on a full disk) are translated there by
`eagle3.diagnose.describe_failure`; anything else is a bug and keeps its traceback.

The classes also derive from the builtin a caller may already catch (ValueError, OSError,
RuntimeError), so raising them instead of the builtin breaks no `except`.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class UserError(Exception):
    """A failure the user can fix; the message names the file / field / row, the bad value and the
    fix."""


class DataLossError(UserError, ValueError):
    """More input rows were skipped than the stage's `max_skipped_fraction` allows."""


class TokenRangeError(UserError, ValueError):
    """Token ids that the target's vocabulary does not hold."""


class DiskFullError(UserError, OSError):
    """A write failed because the filesystem (or the quota) is full."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(errno.ENOSPC, message, None if path is None else str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickled across run_in_subprocess as it was raised
        return type(self), (self.message, self.filename)


def fmt_bytes(num_bytes: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as `df -H` and the planner print them)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def free_bytes(path: str | Path) -> tuple[int | None, Path]:
    """(free bytes, the existing directory they were measured at) for the filesystem that holds
    `path`."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free, p
    except OSError:
        return None, p


def disk_full_error(path: str | Path, needed_bytes: int | None = None) -> DiskFullError:
    """The diagnosis of a write to `path` that the full disk stopped: free and needed space, and the
    fix."""
    free, at = free_bytes(path)
    have = f"{fmt_bytes(free)} free" if free is not None else "free space unknown"
    need = f", {fmt_bytes(needed_bytes)} needed for it" if needed_bytes else ""
    return DiskFullError(
        f"disk full (or quota exceeded) while writing {path} ({have} on the filesystem of {at}"
        f"{need}). Free space there or point --out at a larger disk, then run the same command "
        "again: finished shards and checkpoints are kept and the stage resumes from them",
        path,
    )


#: what torch's zip writer (torch.save) says when its stream fails, which a full disk makes it do
TORCH_WRITE_FAILURES = (
    "inline_container.cc",
    "pytorchstreamwriter failed",
    "unexpected pos",
    "iostream error",
)


def is_disk_full(exc: BaseException, path: str | Path | None = None) -> bool:
    """True for an OSError ENOSPC/EDQUOT, and for torch's writer failing (a RuntimeError that names
    no errno) while the filesystem of `path` has (almost) nothing left."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, RuntimeError) and path is not None:
        text = str(exc).lower()
        if any(m in text for m in TORCH_WRITE_FAILURES):
            free, _ = free_bytes(path)
            return free is not None and free < 1 << 20
    return False
