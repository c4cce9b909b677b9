"""What the benchmark scripts share: when and on what machine a figure was measured, the command
that made it, and writing a result as JSON + markdown (benchmarks/README.md, "Where results go").

Standard library only: the scripts that import it also run on the GPU host (torch and the image's
packages, no pydantic) and in throwaway venvs of other vLLM releases. A script imports it with its
own folder on the path, so that it works run as a script and loaded by file path (the tests):

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import command_line, describe_machine, utc_now, write_result
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the folder that holds the current result of each benchmark
RESULTS = Path(__file__).resolve().parent / "results"


def utc_now() -> str:
    """The time of a measurement, e.g. 2026-12-05T14:03:11+00:00."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def command_line(script: str, argv: list[str] | None = None, drop: tuple[str, ...] = ()) -> str:
    """The command that made a result, as a user retypes it: `python benchmarks/NAME.py ARG ...`.

    `script` is the calling script's __file__; `argv` its arguments (default sys.argv[1:]); flags
    in `drop` (switches that do not change the figures, such as --verbose) are left out.
    """
    shown = Path(script).resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix()
    args = sys.argv[1:] if argv is None else argv
    return "python " + shlex.join([shown, *(a for a in args if a not in drop)])


def code_commit() -> str | None:
    """The repository's commit at the run (short hash), None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=RESULTS.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe_machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU cores, architecture, OS, Python, the load average
    at the call (the cores may be shared) and the GPUs torch sees (only when the script imported
    torch; None without CUDA)."""
    gpus = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_count": os.cpu_count(),
        "arch": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "gpus": gpus,
    }


def machine_line(machine: dict[str, Any]) -> str:
    """describe_machine() in one line, for a markdown header."""
    gpus = machine.get("gpus")
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    return (
        f"{machine['cpu_count']}-core {machine['arch']} CPU, {gpu}, {machine['platform']}, "
        f"Python {machine['python']}, load average {tuple(machine['load_avg'])}"
    )


def write_result(out: Path, payload: Any, markdown: str) -> None:
    """Write OUT.json and OUT.md (`out` without suffix; its folder is made), each atomically: a
    killed run never leaves a half-written result under the final name."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in (
        (".json", json.dumps(payload, indent=1, default=str) + "\n"),
        (".md", markdown),
    ):
        final = out.with_name(out.name + suffix)
        tmp = out.with_name(f".{out.name}{suffix}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)


def fmt(x: float | None, spec: str = ",.1f", unit: str = "") -> str:
    """A figure in a markdown table, e.g. fmt(0.731, ".1%"); – where it was not measured."""
    return "–" if x is None else format(x, spec) + unit
