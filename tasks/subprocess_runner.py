"""Run one library stage in its own process group, streaming its output into the run log.

Why a subprocess: CUDA contexts, vLLM engines and NCCL groups do not reliably let go of a GPU inside
a long-lived worker; a fresh process does, a hard timeout can kill the whole process group (vLLM
spawns engine cores), and a crash cannot take the flow run down with it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_prefect.tasks.errors import ERROR_CLASSES, StageCrashed, StageTimeout

#: default wall-clock limit per stage, overridable with EAGLE3_<STAGE>_TIMEOUT_S
DEFAULT_TIMEOUT_S = {
    "regenerate": 12 * 3600,
    "capture": 24 * 3600,
    "train": 72 * 3600,
    "evaluate": 6 * 3600,
}
KILL_GRACE_S = 15.0

#: "12/345" as printed by tqdm ("45%|####  | 12/345") or "step 12/345"
_PROGRESS_RE = re.compile(r"(?:\|\s*|step\s+|samples?\s+|shard\s+)(\d+)\s*/\s*(\d+)", re.IGNORECASE)


#: a line the child's logging (tasks/_stage_main.py's format) wrote at WARNING or above
_WARNING_RE = re.compile(r"(WARNING|ERROR|CRITICAL) [\w.]+: ")
#: a line vLLM's own logging wrote ("(EngineCore_DP0 pid=12) WARNING 12-03 07:01:02 [file.py:12]
#: ..."): it stays in the stage's log file; only its ERROR/CRITICAL lines reach the run's log too
_VLLM_RE = re.compile(
    r"^(?:\S*\([\w-]+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d "
)
#: the stage's whole output goes to <out>/.eagle3-logs/<stage>-<time>.log (a dot-dir: never part of
#: its outputs)
LOG_DIR = ".eagle3-logs"
#: a temp dir of run_stage_subprocess: eagle3-<stage>-<pid of the process that made it>-<random>
_TMP_RE = re.compile(r"^eagle3-[a-z-]+?-(\d+)-[\w]+$")


def stage_timeout_s(stage: str) -> float:
    env = os.environ.get(f"EAGLE3_{stage.upper()}_TIMEOUT_S")
    return float(env) if env else float(DEFAULT_TIMEOUT_S.get(stage, 6 * 3600))


def build_command(stage: str, config_json: Path, result_json: Path) -> list[str]:
    """The child command line (a function so tests can substitute a failing child)."""
    return [
        sys.executable,
        "-u",
        "-m",
        "eagle3_prefect.tasks._stage_main",
        stage,
        str(config_json),
        str(result_json),
    ]


def parse_progress(line: str) -> float | None:
    """Fraction done from a progress line, or None."""
    m = _PROGRESS_RE.search(line)
    if not m:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if total <= 0 or done > total:
        return None
    return done / total


def remove_stale_temp_dirs(tmp_root: str | Path | None = None) -> list[str]:
    """Delete the temp dirs (config.json, result.json) of stage runs whose process is gone
    (SIGKILLed, a lost host that came back): the names carry the pid; a live pid's dir is kept.
    Returns the removed names."""
    import shutil

    removed = []
    root = Path(tmp_root or tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = _TMP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or someone else's: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


def stage_log_path(stage: str, config: dict[str, Any]) -> Path | None:
    """<out>/.eagle3-logs/<stage>-<UTC time>.log for a stage with an out dir, else None."""
    out = config.get("out")
    if not out:
        return None
    return Path(out) / LOG_DIR / f"{stage}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.log"


def run_stage_subprocess(
    stage: str,
    config: dict[str, Any],
    *,
    timeout_s: float | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None,
    on_progress: Callable[[float], None] | None = None,
    probe: Callable[[], float | None] | None = None,
) -> dict[str, Any]:
    """Run `stage` with `config` in a child process; return the stage result as JSON-able data.

    Progress (0-1) goes to `on_progress`, from the child's progress lines and from `probe` (a
    function reading the stage's own progress files), every ~2 s from the calling thread.
    Raises the StageError subclass matching the child's failure (config / oom / crash /
    engine_start) or StageTimeout after killing the child's process group.
    """
    log = log or logging.getLogger(f"eagle3.tasks.{stage}")
    timeout_s = timeout_s if timeout_s is not None else stage_timeout_s(stage)
    stale = remove_stale_temp_dirs()
    if stale:
        log.info(
            "stage %s: removed %d temp dir(s) of stage runs whose process is gone: %s",
            stage,
            len(stale),
            ", ".join(stale[:5]),
        )
    log_path = stage_log_path(stage, config)
    log_file = None
    if log_path is not None:
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "a", buffering=1, errors="replace")
            log.info("stage %s: its whole output (vLLM's log included) goes to %s", stage, log_path)
        except OSError as e:
            log.warning(
                "stage %s: cannot write its log file %s (%s); vLLM's lines are not kept",
                stage,
                log_path,
                e,
            )
    try:
        return _run(stage, config, timeout_s, log, on_progress, probe, log_file)
    finally:
        if log_file is not None:
            log_file.close()


def _run(
    stage: str,
    config: dict[str, Any],
    timeout_s: float,
    log: Any,
    on_progress: Callable[[float], None] | None,
    probe: Callable[[], float | None] | None,
    log_file: Any,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"eagle3-{stage}-{os.getpid()}-") as tmp:
        config_json, result_json = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_json.write_text(json.dumps(config, default=str))
        cmd = build_command(stage, config_json, result_json)
        log.info("stage %s: starting %s (timeout %.0f s)", stage, " ".join(cmd[:5]), timeout_s)
        t0 = time.time()
        proc = _start(cmd)
        tail: list[str] = []
        progress: list[float] = []
        reader = threading.Thread(
            target=_pump, args=(proc, log, tail, progress, log_file), daemon=True
        )
        reader.start()
        try:
            rc = _wait(stage, proc, reader, t0 + timeout_s, timeout_s, progress, on_progress, probe)
        finally:
            if proc.poll() is None:  # cancelled or interrupted: never leave an engine behind
                _kill_group(proc)
            else:  # it ended (or crashed) on its own: what it started in its group ends with it
                _kill_rest_of_group(proc.pid)
        reader.join(timeout=10)
        return _outcome(stage, rc, _read_report(result_json), tail, time.time() - t0, log)


def _start(cmd: list[str]) -> subprocess.Popen:
    """The stage's process, in a process group of its own, its output piped."""
    env = dict(os.environ)  # the child imports eagle3 / eagle3_prefect as this process does
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        cwd=os.getcwd(),
    )


def _wait(
    stage: str,
    proc: subprocess.Popen,
    reader: threading.Thread,
    deadline: float,
    timeout_s: float,
    progress: list[float],
    on_progress: Callable[[float], None] | None,
    probe: Callable[[], float | None] | None,
) -> int:
    """Wait for the process's exit status, reporting progress; at the deadline kill its group and
    raise StageTimeout."""
    reported = -1.0
    while True:
        try:
            return proc.wait(timeout=min(2.0, max(0.01, deadline - time.time())))
        except subprocess.TimeoutExpired:
            pass
        # progress is reported from this thread: it holds the Prefect run context
        latest = max([*progress[-1:], _probe(probe)], default=None, key=lambda v: v or 0.0)
        if latest is not None and latest - reported >= 0.01:
            reported = latest
            _safe(on_progress, reported)
        if time.time() >= deadline:
            _kill_group(proc)
            reader.join(timeout=5)
            raise StageTimeout(
                stage,
                f"exceeded timeout_s={timeout_s:.0f} (set by "
                f"EAGLE3_{stage.upper()}_TIMEOUT_S); its process group was killed. Raise "
                "that limit or shrink the stage's work",
            )


def _outcome(
    stage: str, rc: int, report: dict[str, Any] | None, tail: list[str], wall_s: float, log: Any
) -> dict[str, Any]:
    """The stage's result from its report, or the error it reported, or a crash naming how the
    process ended and its last output."""
    if rc == 0 and report and report.get("ok"):
        log.info("stage %s: finished in %.1f s", stage, wall_s)
        return report["result"]
    if report and not report.get("ok"):
        cls = ERROR_CLASSES.get(report.get("kind", "crash"), StageCrashed)
        raise cls(stage, f"{report.get('type')}: {report.get('message')}")
    how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
    last = "\n".join(tail[-20:])
    raise StageCrashed(
        stage, f"process {how} after {wall_s:.1f} s without a result; last output:\n{last}"
    )


def relay_level(line: str) -> int | None:
    """The level a child's output line goes to the run's log at; None: the stage's log file only
    (vLLM's own INFO/WARNING/DEBUG lines: engine set-up chatter a person reading the run does not
    act on)."""
    m = _VLLM_RE.match(line)
    if m:
        return logging.WARNING if m.group(1) in ("ERROR", "CRITICAL") else None
    return logging.WARNING if _WARNING_RE.match(line) else logging.INFO


def _pump(
    proc: subprocess.Popen, log: Any, tail: list[str], progress: list[float], log_file: Any = None
) -> None:
    """Copy the child's output into the stage's log file and, but for vLLM's chatter, into the run's
    log line by line (tqdm's \\r updates become progress)."""
    assert proc.stdout is not None
    buf = b""
    while True:
        chunk = (
            proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
        )
        if not chunk:
            break
        buf += chunk
        parts = re.split(rb"[\r\n]", buf)
        buf = parts.pop()
        for raw in parts:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            _write(log_file, line)
            frac = parse_progress(line)
            if frac is not None:
                progress.append(frac)
                del progress[:-2]
                if "\x1b" in line or "%|" in line:  # a progress bar redraw: don't flood the log
                    continue
            tail.append(line)
            del tail[:-200]
            # the child's own warnings stay visible when the log shows warnings only
            # (eagle3.console)
            level = relay_level(line)
            if level is not None:
                (log.warning if level >= logging.WARNING else log.info)("%s", line)
    if buf.strip():
        line = buf.decode(errors="replace").rstrip()
        _write(log_file, line)
        tail.append(line)
        if relay_level(line) is not None:
            log.info("%s", line)


def _write(log_file: Any, line: str) -> None:
    if log_file is None:
        return
    try:
        log_file.write(line + "\n")
    except (OSError, ValueError):  # a full disk or a closed file: the run's log still has the line
        pass


def _probe(probe: Callable[[], float | None] | None) -> float | None:
    if probe is None:
        return None
    try:
        return probe()
    except Exception:  # a progress file mid-write is not an error
        return None


def _safe(fn: Callable[[float], None] | None, value: float) -> None:
    if fn is None:
        return
    try:
        fn(value)
    except Exception:  # progress reporting must never fail the stage
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after KILL_GRACE_S."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # the leader is gone; give the rest of the group (engine cores) the same signal once
            # more
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_rest_of_group(pgid: int) -> None:
    """SIGKILL what is left of the stage's process group (its id is the stage process's pid:
    start_new_session) once the stage process itself has exited: a stage that crashed (SIGKILL, OOM
    killer, segfault) cannot stop the engine processes it started, and they would run on under PID 1
    holding memory and GPUs."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
