"""benchmarks/suite_time.py: per-file sums of a pytest --durations=0 log, and what it refuses."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LOG = """\
============================= slowest durations ==============================
100.50s call     tests/test_flows.py::test_a
20.25s setup    tests/test_flows.py::test_b
30.00s call     tests/test_export.py::test_c[1]
0.25s teardown tests/test_export.py::test_c[1]
=========================== short test summary info ============================
SKIPPED [1] tests/test_model.py:128: flex backward needs CUDA
============ 3 passed, 1 skipped, 1 warning in 80.00s (0:01:20) =============
"""


def _tool():
    spec = importlib.util.spec_from_file_location(
        "suite_time", REPO / "benchmarks" / "suite_time.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sums_per_file_and_writes_both_files(tmp_path):
    tool = _tool()
    (tmp_path / "a.log").write_text(LOG)
    quiet = LOG.replace("100.50s", "50.50s").replace(
        "============ 3 passed", "3 passed"
    )  # -q: no "=" rule
    (tmp_path / "b.log").write_text(
        quiet.replace("in 80.00s (0:01:20) =============", "in 60.00s (0:01:00)")
    )
    assert (
        tool.main(
            [
                "--log",
                f"before={tmp_path / 'a.log'}",
                "--log",
                f"after={tmp_path / 'b.log'}",
                "--out",
                str(tmp_path / "r" / "suite"),
                "--note",
                "test note",
            ]
        )
        == 0
    )
    runs = json.loads((tmp_path / "r" / "suite.json").read_text())["runs"]
    assert runs["before"]["files"] == {"tests/test_flows.py": 120.8, "tests/test_export.py": 30.2}
    assert (
        runs["before"]["wall_s"] == 80.0
        and runs["before"]["sum_s"] == 151.0
        and runs["before"]["overlap"] == 1.89
    )
    assert runs["after"]["files"]["tests/test_flows.py"] == 70.8 and runs["after"]["wall_s"] == 60.0
    assert runs["before"]["result"] == "3 passed, 1 skipped, 1 warning"
    md = (tmp_path / "r" / "suite.md").read_text()
    assert "| tests/test_flows.py | 120.8 | 70.8 |" in md and "test note" in md
    assert not list((tmp_path / "r").glob("*.tmp"))


def test_refuses_logs_it_cannot_read(tmp_path):
    tool = _tool()
    (tmp_path / "cut.log").write_text(LOG.splitlines(keepends=True)[1])
    with pytest.raises(SystemExit, match="no final summary line"):
        tool.main(["--log", f"x={tmp_path / 'cut.log'}", "--out", str(tmp_path / "o")])
    (tmp_path / "none.log").write_text("3 passed in 1.00s\n")  # a summary, but no duration lines
    with pytest.raises(SystemExit, match="--durations=0"):
        tool.main(["--log", f"x={tmp_path / 'none.log'}", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="NAME=PATH"):
        tool.main(["--log", str(tmp_path / "none.log"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o.json").exists()
