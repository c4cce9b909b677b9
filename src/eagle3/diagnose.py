"""Failures the user can act on, turned into one message: what happened, where, and what to do.

Used by the CLI (`eagle3 ...` prints the message and exits non-zero; the traceback only with --verbose) and by the
Prefect tasks (tasks/errors.py), so both say the same thing. `describe_failure` returns None for an exception that
is not one of these (a bug: its traceback is what helps)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from safetensors import SafetensorError

from eagle3.config import ConfigError
from eagle3.lock import LockedError


#: exceptions whose message is already the diagnosis (they name the file/field and the fix)
def _known() -> tuple[type[BaseException], ...]:
    return (ConfigError, LockedError, FileNotFoundError, NotADirectoryError, ValueError)


def _free(path: str) -> str:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"{shutil.disk_usage(p).free / 1e9:.2f} GB free on the filesystem of {p} now"
    except OSError:
        return "free space unknown"


def describe_failure(exc: BaseException) -> str | None:
    """The diagnosis of `exc`, or None when it is not a failure the user can act on (a bug)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = exc.filename or "?"
        return (f"disk full (or quota exceeded) while writing {where} ({_free(str(where))}). Free space there or point "
                "--out at a larger disk, then run the same command again: finished shards/checkpoints are kept and the "
                "stage resumes")
    if isinstance(exc, PermissionError) or (isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM)):
        where = exc.filename or "?"
        return (f"permission denied on {where} (running as uid {os.getuid()}): make it readable/writable for this "
                "user (chmod/chown) or choose a directory you own")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"{exc.filename or '?'} is on a read-only filesystem: write the outputs to a writable directory"
    if isinstance(exc, SafetensorError):
        return (f"a safetensors file is truncated or corrupt ({exc}); rerun with --verbose to see which read failed, "
                "then delete or recreate that file")
    if isinstance(exc, _known()):
        return str(exc)
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({exc.filename or 'no file named'}): check the path, the disk and the mount"
    return None
