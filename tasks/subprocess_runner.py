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
DEFAULT_TIMEOUT_S = {"regenerate": 12 * 3600, "capture": 24 * 3600, "train": 72 * 3600, "evaluate": 6 * 3600}
KILL_GRACE_S = 15.0

#: "12/345" as printed by tqdm ("45%|####  | 12/345") or "step 12/345"
_PROGRESS_RE = re.compile(r"(?:\|\s*|step\s+|samples?\s+|shard\s+)(\d+)\s*/\s*(\d+)", re.IGNORECASE)


#: a line the child's logging (tasks/_stage_main.py's format) wrote at WARNING or above
_WARNING_RE = re.compile(r"(WARNING|ERROR|CRITICAL) [\w.]+: ")


def stage_timeout_s(stage: str) -> float:
    env = os.environ.get(f"EAGLE3_{stage.upper()}_TIMEOUT_S")
    return float(env) if env else float(DEFAULT_TIMEOUT_S.get(stage, 6 * 3600))


def build_command(stage: str, config_json: Path, result_json: Path) -> list[str]:
    """The child command line (a function so tests can substitute a failing child)."""
    return [sys.executable, "-u", "-m", "eagle3_prefect.tasks._stage_main", stage, str(config_json), str(result_json)]


def parse_progress(line: str) -> float | None:
    """Fraction done from a progress line, or None."""
    m = _PROGRESS_RE.search(line)
    if not m:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if total <= 0 or done > total:
        return None
    return done / total


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

    Progress (0-1) goes to `on_progress`, from the child's progress lines and from `probe` (a function
    reading the stage's own progress files), every ~2 s from the calling thread.
    Raises the StageError subclass matching the child's failure (config / oom / crash / engine_start)
    or StageTimeout after killing the child's process group.
    """
    log = log or logging.getLogger(f"eagle3.tasks.{stage}")
    timeout_s = timeout_s if timeout_s is not None else stage_timeout_s(stage)
    with tempfile.TemporaryDirectory(prefix=f"eagle3-{stage}-") as tmp:
        config_json, result_json = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_json.write_text(json.dumps(config, default=str))
        env = dict(os.environ)  # the child imports eagle3 / eagle3_prefect as this process does (installed)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = build_command(stage, config_json, result_json)
        log.info("stage %s: starting %s (timeout %.0f s)", stage, " ".join(cmd[:5]), timeout_s)
        t0 = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=os.getcwd(),
        )
        tail: list[str] = []
        progress: list[float] = []
        reader = threading.Thread(target=_pump, args=(proc, log, tail, progress), daemon=True)
        reader.start()
        deadline = t0 + timeout_s
        reported = -1.0
        try:
            while True:
                try:
                    rc = proc.wait(timeout=min(2.0, max(0.01, deadline - time.time())))
                    break
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
                        stage, f"exceeded timeout_s={timeout_s:.0f} (set by EAGLE3_{stage.upper()}_TIMEOUT_S); "
                        "its process group was killed. Raise that limit or shrink the stage's work")
        finally:
            if proc.poll() is None:  # cancelled or interrupted: never leave an engine behind
                _kill_group(proc)
            else:  # it ended (or crashed) on its own: what it started in its group ends with it
                _kill_rest_of_group(proc.pid)
        reader.join(timeout=10)
        wall_s = time.time() - t0
        report = _read_report(result_json)
        if rc == 0 and report and report.get("ok"):
            log.info("stage %s: finished in %.1f s", stage, wall_s)
            return report["result"]
        if report and not report.get("ok"):
            cls = ERROR_CLASSES.get(report.get("kind", "crash"), StageCrashed)
            raise cls(stage, f"{report.get('type')}: {report.get('message')}")
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        last = "\n".join(tail[-20:])
        raise StageCrashed(stage, f"process {how} after {wall_s:.1f} s without a result; last output:\n{last}")


def _pump(proc: subprocess.Popen, log: Any, tail: list[str], progress: list[float]) -> None:
    """Copy the child's output into the log line by line (tqdm's \\r updates become progress)."""
    assert proc.stdout is not None
    buf = b""
    while True:
        chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
        if not chunk:
            break
        buf += chunk
        parts = re.split(rb"[\r\n]", buf)
        buf = parts.pop()
        for raw in parts:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            frac = parse_progress(line)
            if frac is not None:
                progress.append(frac)
                del progress[:-2]
                if "\x1b" in line or "%|" in line:  # a progress bar redraw: don't flood the log
                    continue
            tail.append(line)
            del tail[:-200]
            # the child's own warnings stay visible when the log shows warnings only (eagle3.console)
            (log.warning if _WARNING_RE.match(line) else log.info)("%s", line)
    if buf.strip():
        line = buf.decode(errors="replace").rstrip()
        tail.append(line)
        log.info("%s", line)


def _probe(probe: Callable[[], float | None] | None) -> float | None:
    if probe is None:
        return None
    try:
        return probe()
    except Exception:  # noqa: BLE001 - a progress file mid-write is not an error
        return None


def _safe(fn: Callable[[float], None] | None, value: float) -> None:
    if fn is None:
        return
    try:
        fn(value)
    except Exception:  # noqa: BLE001 - progress reporting must never fail the stage
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
            # the leader is gone; give the rest of the group (engine cores) the same signal once more
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
