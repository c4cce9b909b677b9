"""Failures the user can act on, turned into one message: what happened, where, and what to do.

The one error path (eagle3.errors): stages raise `UserError` where the cause is known, and this
module is the top-level translation for everything else. Used by the CLI (`eagle3 ...` prints the
message and exits non-zero; the traceback only with --verbose) and by the Prefect tasks
(tasks/_stage_main.py), so both say the same thing. `describe_failure` returns None for an exception
that is neither a UserError nor a well-known family (a bug: its traceback is what helps).
"""

from __future__ import annotations

import errno
import os

from safetensors import SafetensorError

from eagle3.errors import UserError, disk_full_error, is_disk_full


#: exceptions whose message is already the diagnosis besides UserError (raised by the library with a
#: file / field and a fix in their message, but not yet as UserError)
def _known() -> tuple[type[BaseException], ...]:
    return (FileNotFoundError, NotADirectoryError, ValueError)


def describe_failure(exc: BaseException) -> str | None:
    """The diagnosis of `exc` as one paragraph, or None when it is not a failure the user can act on
    (a bug)."""
    if isinstance(exc, UserError):
        return " ".join(str(exc).split("\n"))
    message = translate(exc)
    return None if message is None else " ".join(message.split("\n"))


def translate(exc: BaseException) -> str | None:
    """Well-known exception families that reach the top without passing a boundary that knew their
    cause."""
    if isinstance(exc, OSError) and is_disk_full(exc):
        return str(disk_full_error(exc.filename or "?"))
    if isinstance(exc, PermissionError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM)
    ):
        where = exc.filename or "?"
        return (
            f"permission denied on {where} (running as uid {os.getuid()}): make it "
            "readable/writable for this user (chmod/chown) or choose a directory you own"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return (
            f"{exc.filename or '?'} is on a read-only filesystem: write the outputs to a writable "
            "directory"
        )
    if isinstance(exc, SafetensorError):
        return (
            f"a safetensors file is truncated or corrupt ({exc}); rerun with --verbose to see "
            "which read failed, then delete or recreate that file"
        )
    if isinstance(exc, _known()):
        return str(exc)
    if isinstance(exc, OSError):
        return (
            f"{exc.strerror or exc} ({exc.filename or 'no file named'}): check the path, the disk "
            "and the mount"
        )
    return None
