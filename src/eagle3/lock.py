"""One writer per directory: an advisory lock (fcntl.flock) on `<dir>/.eagle3.lock`.

Two captures into one --out, or two trainings into one out dir, corrupt each other (a second
capture's start-up deletes the shards the first one just wrote). `dir_lock(path, what)` makes the
second one fail at once, naming the holder (pid, host, command, start time, and the orchestrator's
run when the caller names it: `holder=`), which the lock file records as JSON.

A process that dies (SIGKILL, OOM, a lost node) releases its flock with its file descriptors; the
file it leaves says who held it, so the next writer reports that it takes over a stale lock and goes
on (`on_stale` is called with that record, so an orchestrator can close the run that held it). The
file is unlinked on release; a writer that locked a file someone unlinked meanwhile tries again on
the new file (the lock is on the inode, and the name must still point to it).

A stage that starts engine processes (vLLM's engine core and workers, a job of
eagle3.vllm_engine.run_in_subprocess) records them in the lock files it holds
(`record_engine_processes`: pid, start time, name). They end with their parent
(eagle3.processes.die_with_parent), but if some survive a run that died anyway, the next writer of
the directory finds them still running (same pid and start time, read from /proc) and stops, naming
them and the kill command, instead of starting a second engine beside them (or letting a worker that
writes shards race the new run).

Re-entrant within a process (the pipeline locks its work dir, a stage locks its out dir under it; a
stage called twice in one process is fine). flock is advisory and local to the host on most network
filesystems: two hosts writing one NFS directory are not stopped by it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3 import processes
from eagle3.errors import UserError, fmt_bytes

LOCK_NAME = ".eagle3.lock"

_held: dict[str, int] = {}  # realpath of the lock file -> re-entry count (this process)
_fds: dict[str, int] = {}  # realpath of the lock file -> its open descriptor (held here)
_held_guard = threading.Lock()


class LockedError(UserError, RuntimeError):
    """Another live process writes this directory."""


class StaleEngineError(UserError, RuntimeError):
    """Engine processes of an earlier run on this directory still run after that run died."""


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe_holder(h: dict) -> str:
    """The holder recorded in a lock file, in words: its run (name, id, link) when recorded, then
    its process."""
    if not h:
        return "an unknown process"
    proc = (
        f"pid {h.get('pid')} on host {h.get('host')} (`{h.get('command', '?')}`, since "
        f"{h.get('started', '?')})"
    )
    if not h.get("flow_run_name") and not h.get("flow_run_id"):
        return proc
    where = ", ".join(str(h[k]) for k in ("flow_run_id", "flow_run_url") if h.get(k))
    return f"flow run {h.get('flow_run_name') or '?'!r} ({where}): {proc}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def dir_lock(
    directory: str | Path,
    what: str = "directory",
    holder: dict | None = None,
    on_stale: Callable[[dict], None] | None = None,
) -> Iterator[Path]:
    """Hold the writer lock of `directory` (created if missing) for the block; `what` names the
    directory in errors (e.g. "capture out"). Raises LockedError naming the holder when another live
    process has it.

    holder: fields recorded beside pid/host/command (`flow_run_name`, `flow_run_id`, `flow_run_url`:
    the run that holds the lock, named in the error a second writer gets). on_stale(record): called
    once the lock is taken over from a holder that is gone, with what its lock file said."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    key = os.path.realpath(path)
    with _held_guard:
        if key in _held:
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _held_guard:
                _held[key] -= 1
                if not _held[key]:
                    del _held[key]
        return
    fd, stale = _acquire(path, what, holder or {})
    with _held_guard:
        _held[key] = 1
        _fds[key] = fd
    try:
        if stale and on_stale is not None:
            on_stale(stale)
        yield path
    finally:
        with _held_guard:
            _held.pop(key, None)
            _fds.pop(key, None)
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                path.unlink()
        os.close(fd)


def _acquire(path: Path, what: str, extra: dict) -> tuple[int, dict]:
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            h = _holder(path)
            here = h.get("host") == socket.gethostname()
            if h.get("pid") is not None and here and not _pid_alive(int(h["pid"])):
                # the holder died; a child of it kept the lock open
                _raise_if_stale_engines(path, what, h)
            raise LockedError(
                f"{what} {path.parent} is being written by {describe_holder(h)}: one writer per "
                "directory. Wait for it to finish, stop it, or use another directory "
                f"(lock file {path})"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # unlinked by its previous holder after we opened it: lock the new file
            os.close(fd)
            continue
        old = _holder(path)
        if old.get("pid") is not None:
            alive = old.get("host") == socket.gethostname() and _pid_alive(int(old["pid"]))
            if old.get("host") == socket.gethostname():
                try:
                    _raise_if_stale_engines(path, what, old)
                except StaleEngineError:
                    os.close(fd)
                    raise
            old["state"] = "dead" if not alive else "no longer holding it"
            print(
                f"eagle3: taking over the stale lock of {what} {path.parent} left by "
                f"{describe_holder(old)} ({old['state']})",
                file=sys.stderr,
                flush=True,
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv)[:300],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **{k: v for k, v in extra.items() if v is not None},
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return fd, old if old.get("pid") is not None else {}
    raise LockedError(
        f"{what} {path.parent}: could not take the lock file {path} (it keeps being replaced)"
    )


def _raise_if_stale_engines(path: Path, what: str, holder: dict) -> None:
    """StaleEngineError when engine processes that `holder` (an earlier writer's lock record) listed
    still run."""
    left = [
        e
        for e in holder.get("engines") or []
        if isinstance(e, dict)
        and e.get("pid")
        and processes.is_running(int(e["pid"]), e.get("start_time"))
    ]
    if not left:
        return
    pids = " ".join(str(int(e["pid"])) for e in left)

    def one(e: dict) -> str:
        rss = processes.rss_bytes(int(e["pid"]))
        return f"pid {int(e['pid'])} ({e.get('name') or processes.name(int(e['pid']))}" + (
            f", {fmt_bytes(rss)} RSS)" if rss else ")"
        )

    raise StaleEngineError(
        f"{what} {path.parent}: the run that wrote it before ({describe_holder(holder)}) is gone, "
        f"but {len(left)} engine process(es) it started still run: "
        f"{', '.join(one(e) for e in left)}. They hold memory (and GPUs) and may still write here: "
        f"end them with `kill {pids}` (`kill -9 {pids}` if they stay), then run again (lock file "
        f"{path})"
    )


#: helper processes of multiprocessing that end by themselves once their clients are gone (not
#: engines). The fork server is kept: its jobs carry its command line (an evaluate job is the
#: engine), and it runs on only while a job does
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker")


def record_engine_processes() -> list[dict]:
    """Write the processes below this one (the engines a stage started: pid, start time, name) into
    every lock file this process holds, so that the next writer of those directories finds them if
    they outlive this run. Call it once an engine has started (and again when the set changes); a
    process that holds no lock records nothing. Returns the list recorded."""
    with _held_guard:
        held = list(_fds.items())
    if not held:
        return []
    engines = []
    for pid in processes.descendants():
        started, title = processes.start_time(pid), processes.name(pid)
        if started is None or any(h in title for h in _HELPERS):
            continue
        engines.append({"pid": pid, "start_time": started, "name": title})
    for _, fd in held:
        try:
            raw = os.pread(fd, 1 << 20, 0)
            record = json.loads(raw.decode() or "{}")
        except (OSError, ValueError):
            continue
        if record.get("engines") == engines:
            continue
        record["engines"] = engines
        data = json.dumps(record).encode()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
    return engines
