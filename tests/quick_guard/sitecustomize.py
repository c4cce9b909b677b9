"""Loaded by every Python process of the quick tier (`bash scripts/test.sh --quick` puts this
directory on PYTHONPATH, so the stage subprocesses and engine jobs of a test load it too): the quick
tier starts no vLLM engine and no Prefect API server. A test that would is stopped where it starts
one, with an error that names the mark it lacks. Importing vLLM or Prefect stays allowed."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

#: module -> (class, the method that starts it, what it starts, the mark a test doing it needs)
GUARDS = {
    "vllm.entrypoints.llm": ("LLM", "__init__", "a vLLM engine", "vllm"),
    "prefect.server.api.server": (
        "SubprocessASGIServer",
        "start",
        "a Prefect API server",
        "prefect",
    ),
}


class QuickTierError(RuntimeError):
    """A test of the quick tier started what the tier leaves out."""


def refuse(what: str, mark: str):
    def start(*args, **kwargs):
        raise QuickTierError(
            f"the quick tier (bash scripts/test.sh --quick) starts no {what}: mark this test "
            f"@pytest.mark.{mark}, or list it in tests/conftest.py MARKED_HERE; the full suite "
            "still runs it"
        )

    return start


class GuardFinder(importlib.abc.MetaPathFinder):
    """Finds a guarded module as usual, then replaces its starting method once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name not in GUARDS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        cls_name, method, what, mark = GUARDS[name]

        def exec_and_guard(module):
            exec_module(module)
            setattr(getattr(module, cls_name), method, refuse(what, mark))

        spec.loader.exec_module = exec_and_guard
        return spec


if not any(isinstance(f, GuardFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, GuardFinder())
