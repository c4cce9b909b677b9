"""A killed stage takes its vLLM engine along (hostile test of 2026-12-03: `eagle3 capture` killed
with SIGKILL left `VLLM::EngineCore` and `VLLM::Worker` running under PID 1, ~3.6 GB RSS).

The capture runs as the `eagle3` command with vLLM's own process layout (engine core and worker
spawned by vLLM). It is killed once the worker process exists: by then vLLM has loaded its general
plugins in both processes (eagle3.vllm_ext.die_with_parent_plugin), the engine core before
it starts its workers and the worker before it names itself `VLLM::Worker`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_capture import make_prepared
from test_errors import _alive, _start_time, _wait_gone


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc (parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        return ""


def test_sigkilled_capture_leaves_no_engine_process(tiny_llama, tmp_path):
    prepared = make_prepared(tiny_llama, tmp_path / "prepared", num=8)
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }  # vLLM's own processes
    log = open(tmp_path / "capture.log", "w")
    cap = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "capture",
            "--target",
            str(tiny_llama),
            "--data",
            str(prepared),
            "--out",
            str(tmp_path / "cap"),
            "--backend",
            "vllm",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    engines: dict[int, int] = {}
    try:
        deadline = time.time() + 480  # a vLLM engine start on a loaded 2-core host
        while time.time() < deadline and cap.poll() is None:
            below = descendants(cap.pid)
            if any(cmdline(p).startswith("VLLM::Worker") for p in below):
                engines = {p: _start_time(p) for p in below if _alive(p)}
                break
            time.sleep(0.1)
        assert engines, (
            f"no VLLM::Worker appeared (exit code {cap.poll()}):\n"
            + (tmp_path / "capture.log").read_text()[-3000:]
        )
        names = {p: cmdline(p) for p in engines}
        assert any(n.startswith("VLLM::EngineCore") for n in names.values()), names
        cap.send_signal(signal.SIGKILL)
        cap.wait(timeout=30)
        t0 = time.time()
        left = [p for p in _wait_gone(list(engines), 10) if _start_time(p) == engines[p]]
        assert not left, (
            f"left running after the capture was killed: {[(p, names[p]) for p in left]}"
        )
        print(
            f"engine processes {sorted(names.values())} ended {time.time() - t0:.1f} s after the "
            "kill"
        )
    finally:
        if cap.poll() is None:
            cap.kill()
        for p, started in engines.items():
            if _alive(p) and _start_time(p) == started:
                os.kill(p, signal.SIGKILL)
        log.close()
