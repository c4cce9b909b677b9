"""Which vLLM releases eagle3 runs with, and the check every engine start makes.

The range is the releases whose every internal touched by eagle3.vllm_ext (its TOUCHPOINTS table)
was checked in the release's own sources (`benchmarks/vllm_touchpoints.py`,
benchmarks/results/vllm_touchpoints.md), from vLLM 0.16 (Model Runner V1 everywhere, V2 opt-in)
to 0.34 (V2 only: V1 removed). Which of them capture was also run on, on which device and runner:
benchmarks/results/vllm_cpu_matrix.md and docs/decisions/0019-vllm-versions.md.

A vLLM outside the range is refused at engine start with one line naming it, the range and what
to do; EAGLE3_ALLOW_UNTESTED_VLLM=1 in the environment turns the refusal into a warning (the
capture extension still refuses a model runner it does not know: it cannot read such a runner's
batch). This module imports neither vLLM nor torch: it reads the installed distribution's
metadata.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata

from eagle3.errors import UserError

log = logging.getLogger(__name__)

#: the first and the last vLLM release (major, minor) of the tested range, both included
TESTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 16), (0, 34))
#: the environment variable that lets an engine start with a vLLM outside TESTED_VLLM
ALLOW_UNTESTED_ENV = "EAGLE3_ALLOW_UNTESTED_VLLM"
#: the distributions that install the `vllm` package: the CUDA build and the CPU build
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVLLMError(UserError, RuntimeError):
    """The installed vLLM (or the model runner it built) is one eagle3 was not tested with."""


def tested_range() -> str:
    """'0.16 to 0.34': the tested range as the error lines print it."""
    (a, b), (c, d) = TESTED_VLLM
    return f"{a}.{b} to {c}.{d}"


def pip_requirement() -> str:
    """'vllm>=0.16,<0.35': the requirement of pyproject's `gpu` extra."""
    (a, b), (c, d) = TESTED_VLLM
    return f"vllm>={a}.{b},<{c}.{d + 1}"


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, e.g. ('vllm-cpu', '0.32.0'); None when
    neither build is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_minor(version: str) -> tuple[int, int] | None:
    """'0.34.0+cu130' -> (0, 34); None for a string that does not start with two numbers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def in_tested_range(version: str) -> bool:
    """Is this release inside TESTED_VLLM (by major and minor version: 0.34.1 is in)?"""
    minor = parse_minor(version)
    return minor is not None and TESTED_VLLM[0] <= minor <= TESTED_VLLM[1]


def untested_message(version: str, distribution: str = "vllm") -> str:
    """The one line for a vLLM outside the tested range: the release, the range, what to do."""
    return (
        f"{distribution} {version} is outside the vLLM releases eagle3 is tested with "
        f"({tested_range()}): install one of them (`pip install '{pip_requirement()}'`, or the "
        f"`gpu` extra), or set {ALLOW_UNTESTED_ENV}=1 to start the engine anyway "
        "(`python benchmarks/vllm_touchpoints.py --installed` in a checkout shows which vLLM "
        "internals eagle3 touches that this release lacks)"
    )


def check_vllm_version(version: str | None = None, distribution: str | None = None) -> None:
    """Refuse a vLLM outside the tested range (UnsupportedVLLMError, one line), or warn when
    EAGLE3_ALLOW_UNTESTED_VLLM=1. `version`: the release to judge (default: the installed one;
    nothing to judge when no vLLM is installed: the import that follows says so)."""
    if version is None:
        found = installed_vllm()
        if found is None:
            return
        distribution, version = found
    if in_tested_range(version):
        return
    message = untested_message(version, distribution or "vllm")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        log.warning("%s (%s=1: starting it anyway)", message, ALLOW_UNTESTED_ENV)
        return
    raise UnsupportedVLLMError(message)
