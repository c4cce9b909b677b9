"""The quick tier (`bash scripts/test.sh --quick`): which tests it leaves out, and its guard against
vLLM engines and Prefect API servers (tests/quick_guard/sitecustomize.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import add_quick_tier_marks

ROOT = Path(__file__).resolve().parents[1]


class FakeItem:
    def __init__(self, nodeid: str, fixturenames: tuple[str, ...] = ()):
        self.nodeid, self.fixturenames, self.marks = nodeid, fixturenames, set()

    def add_marker(self, mark: str) -> None:
        self.marks.add(mark)


@pytest.mark.parametrize(
    ("nodeid", "fixtures", "marks"),
    [
        (
            "tests/test_capture.py::test_manifest_and_reader",
            ("vllm_llama", "prepared_llama"),
            {"vllm"},
        ),
        (
            "tests/test_regenerate.py::test_regenerate_resume_after_kill",
            ("tiny_llama", "llm"),
            {"vllm"},
        ),
        (
            "tests/test_stream.py::test_pipeline_flow_streams_when_enabled",
            ("prefect_harness",),
            {"prefect"},
        ),
        ("tests/test_flows.py::test_anything_new", (), {"prefect"}),
        ("tests/test_evaluate.py::test_evaluate_random_draft", ("tiny_llama",), {"vllm"}),
        ("tests/test_train.py::test_resume_is_exact[plain]", ("captured",), {"slow"}),
        (
            "tests/test_sampling_fix.py::"
            "test_cpu_rejection_sampler_accepts_with_target_probability[0.9]",
            (),
            {"slow"},
        ),
        ("tests/test_capture.py::test_bad_layer_ids[x]", ("tiny_llama", "prepared_llama"), set()),
        ("tests/test_config.py::test_anything", (), set()),
    ],
)
def test_marks_by_fixture_and_by_name(nodeid, fixtures, marks):
    item = FakeItem(nodeid, fixtures)
    add_quick_tier_marks(item)
    assert item.marks == marks


def run_test_command(*args: str) -> list[str]:
    return subprocess.run(
        ["bash", "scripts/test.sh", "--dry-run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.splitlines()


def test_the_test_command_selects_the_quick_tier():
    quick = run_test_command("--quick", "-x")
    assert quick[0].startswith(f"PYTHONPATH={ROOT}/tests/quick_guard")
    assert quick[-1].split() == [
        ".venv/bin/python",
        "-m",
        "pytest",
        "-m",
        "not\\",
        "vllm\\",
        "and\\",
        "not\\",
        "slow\\",
        "and\\",
        "not\\",
        "prefect",
        "-x",
    ]
    full = run_test_command()
    assert not any("quick_guard" in line for line in full)
    assert full[-1].split() == [".venv/bin/python", "-m", "pytest"]


@pytest.mark.slow  # imports vLLM and Prefect's server in a child process (~20 s on 2 cores)
def test_the_guard_stops_an_engine_and_a_prefect_api_and_names_the_mark():
    code = (
        "from vllm import LLM\n"
        "try:\n"
        "    LLM(model='/nonexistent-target')\n"
        "except Exception as e:\n"
        "    print('vllm', type(e).__name__, e)\n"
        "from prefect.server.api.server import SubprocessASGIServer\n"
        "print('prefect start', SubprocessASGIServer.start.__qualname__)\n"
        "try:\n"
        "    SubprocessASGIServer.start(None)\n"
        "except Exception as e:\n"
        "    print('prefect', type(e).__name__, e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "quick_guard")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    ).stdout
    assert "vllm QuickTierError" in out and "@pytest.mark.vllm" in out, out
    # the guard replaced the method before anything could call it: no server was started
    assert "prefect start refuse.<locals>.start" in out, out
    assert "prefect QuickTierError" in out and "@pytest.mark.prefect" in out, out


def test_units_of_work_split_only_the_listed_tests_and_name_real_tests():
    """conftest.unit_of: a test's file is its unit of work under xdist, except a SEPARATE_UNITS
    test; every SEPARATE_UNITS and LONGEST_UNITS entry names a file and test that exist (a renamed
    test would otherwise silently lose its place)."""
    from conftest import LONGEST_UNITS, SEPARATE_UNITS, unit_of

    cli = "tests/test_flows.py::test_eagle3_run_uses_the_flow_and_caches_across_processes"
    assert unit_of(cli) == cli.removeprefix("tests/")
    assert unit_of("tests/test_flows.py::test_first_run_executes_every_stage_and_reports") == (
        "test_flows.py"
    )
    accepts = "tests/test_export.py::test_vllm_accepts_tokens_of_a_trained_draft"
    assert unit_of(accepts) == unit_of(f"{accepts}[a]") == accepts.removeprefix("tests/")
    assert unit_of("tests/test_export.py::test_export_vllm_layout") == "test_export.py"
    assert set(SEPARATE_UNITS) <= set(LONGEST_UNITS)
    assert len(set(LONGEST_UNITS)) == len(LONGEST_UNITS), LONGEST_UNITS
    for unit in LONGEST_UNITS:
        file, _, test = unit.partition("::")
        path = ROOT / "tests" / file
        assert path.is_file(), unit
        assert not test or f"def {test}(" in path.read_text(), unit
