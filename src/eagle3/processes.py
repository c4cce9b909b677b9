"""Processes that must not outlive the run that started them (Linux; elsewhere these do nothing).

`die_with_parent()` makes the calling process receive SIGKILL when its parent dies (prctl
PR_SET_PDEATHSIG), and exits at once when the parent is already gone. Called at the top of every
process that exists only to serve its parent: vLLM's engine-core and worker processes, through a
vLLM plugin (eagle3.capture.vllm_ext). Chained, a SIGKILL or SIGTERM of `eagle3 capture` ends its
engine core, whose end ends its workers (tests/test_engine_lifetime.py). A job of
eagle3.vllm_engine.run_in_subprocess is a child of multiprocessing's fork server, which outlives the
caller while a job runs: the job watches the caller itself (`watch_process`).

The rest reads /proc: the processes below this one (the engines a stage started, recorded in its
directory's lock file by eagle3.lock), and whether a recorded process still runs (pid and start
time, so a reused pid is not taken for it).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1

#: "1" in the environment of a process that starts vLLM engines
#: (eagle3.vllm_engine.engines_die_with_parent): its engine processes call die_with_parent (the vLLM
#: plugin in eagle3.capture.vllm_ext)
DIE_WITH_PARENT_ENV = "EAGLE3_ENGINE_DIES_WITH_PARENT"


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent dies; exit now (status 1) if
    `parent_pid` (default: multiprocessing's record of the process that started this one, when it is
    a multiprocessing child) died before the signal was armed. (A fork server's child has the server
    as its parent but the server's client as `parent_pid`: while that client runs, nothing is
    wrong.) The signal follows the parent *thread* that started this process: start such processes
    from a thread that lives as long as they should. Returns False where prctl is not available (not
    Linux)."""
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid and not is_running(parent_pid):
        os._exit(1)  # it died before the signal was armed
    return True


def watch_process(pid: int, interval_s: float = 0.5) -> None:
    """SIGKILL this process (and so, through their parent-death signal, what it started) once `pid`
    no longer runs: a daemon thread polling /proc. For a process whose real parent outlives the one
    it serves: a job forked by multiprocessing's fork server, which stays up while any job holds its
    pipe, serves the caller that asked for it."""
    started = start_time(pid)
    if started is None:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while is_running(pid, started):
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"eagle3-watch-{pid}", daemon=True).start()


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3, the state, first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot: /proc/PID/stat field 22), or None when it does
    not run."""
    st = _stat(pid)
    return int(st[19]) if st and len(st) > 19 else None


def is_running(pid: int, started: int | None = None) -> bool:
    """True while `pid` runs (a zombie counts as gone) and, with `started`, is still the process
    that started then."""
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return started is None or int(st[19]) == int(started)


def name(pid: int) -> str:
    """The process's command line as `ps` shows it (vLLM retitles its processes VLLM::EngineCore,
    VLLM::Worker)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def descendants(root: int | None = None) -> list[int]:
    """Every process below `root` (default: this one), parents before children."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for d in entries:
        st = _stat(int(d))
        if st is not None and len(st) > 1:
            children.setdefault(int(st[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in sorted(children.get(todo.pop(0), [])):
            out.append(c)
            todo.append(c)
    return out
