"""scripts/structure.py (the structure figures in docs/structure.md) counts what it says, on a
checkout built here: long functions, `# noqa` comments, imports against the library's layers,
repeated code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def body(num_lines: int, name: str) -> str:
    """A function `name` of exactly `num_lines` lines."""
    return f"def {name}():\n" + "    x = 1\n" * (num_lines - 2) + "    return x\n"


def measure(root: Path) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure.py"), "--root", str(root), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def write_checkout(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


PYPROJECT = """
    [[tool.importlinter.contracts]]
    id = "library-layers"
    type = "layers"
    containers = ["eagle3"]
    layers = ["cli", "stage_a | stage_b", "config : io"]
    """


def test_structure_counts_a_checkout(tmp_path):
    kept = body(70, "kept").replace("():\n", '():\n    """Kept whole: one loop."""\n', 1)
    files = {
        "pyproject.toml": PYPROJECT,
        "src/eagle3/__init__.py": "",
        "src/eagle3/cli.py": "from eagle3 import stage_a\n",
        "src/eagle3/stage_a/__init__.py": "from .run import go\n",
        "src/eagle3/stage_a/run.py": body(61, "go") + body(60, "fits"),
        "src/eagle3/stage_b.py": """
            from typing import TYPE_CHECKING

            from eagle3.config import X

            if TYPE_CHECKING:
                from eagle3.cli import Y

            def late():
                from eagle3.stage_a.run import go  # noqa: F401 - sideways
            """,
        "src/eagle3/config.py": "def f():\n    from eagle3 import cli\n",
        "src/eagle3/io.py": "from eagle3.config import f\n" + kept,
        "flows/pipeline.py": body(80, "flow") + "import os  # noqa: F401\n",
    }
    write_checkout(tmp_path, files)
    m = measure(tmp_path)
    assert m["modules"] == {"library": 7, "prefect": 1}
    assert [(f["lines"], f["where"], f["kept_whole"]) for f in m["long_functions"]] == [
        (80, "flows/pipeline.py:1 flow", False),
        (71, "src/eagle3/io.py:2 kept", True),
        (61, "src/eagle3/stage_a/run.py:1 go", False),
    ]
    assert m["num_long_functions"] == 3 and m["num_long_functions_unexplained"] == 2
    assert m["num_noqa"] == 2 and m["num_library_layers"] == 3
    assert m["upward_imports"] == ["eagle3.config -> eagle3.cli"]
    assert m["sideways_imports"] == ["eagle3.stage_b -> eagle3.stage_a.run.go"]


def test_route_follows_the_config_through_the_library(tmp_path):
    """scripts/route.py walks the calls that hand on the config from run_pipeline: stops at config
    parameters and config methods, a declared stage function through the registry, the climbs back
    up the layers, and the head before the first stage."""
    files = {
        "pyproject.toml": """
            [[tool.importlinter.contracts]]
            id = "library-layers"
            type = "layers"
            containers = ["eagle3"]
            layers = ["pipeline", "stages", "stage_a", "config"]
            """,
        "src/eagle3/__init__.py": "",
        "src/eagle3/config.py": """
            from pydantic import BaseModel

            class StageConfig(BaseModel):
                def require(self) -> None:
                    pass

            class AConfig(StageConfig):
                pass

            class PipelineConfig(BaseModel):
                a: AConfig

                def resolved(self) -> "PipelineConfig":
                    return self
            """,
        "src/eagle3/stage_a.py": """
            from eagle3.config import AConfig

            def run_a(cfg: AConfig) -> None:
                cfg.require()
                helper(cfg, 3)
                helper(cfg, 4)

            def helper(cfg: AConfig, n: int) -> None:
                print(n)
            """,
        "src/eagle3/stages.py": """
            import importlib

            from eagle3.config import StageConfig

            FUNCTIONS = {"a": "eagle3.stage_a:run_a"}

            def run_stage_function(name: str, cfg: StageConfig) -> None:
                module, func = FUNCTIONS[name].split(":")
                getattr(importlib.import_module(module), func)(cfg)
            """,
        "src/eagle3/pipeline.py": """
            from eagle3.config import PipelineConfig
            from eagle3.stages import run_stage_function

            def run_pipeline(cfg: PipelineConfig) -> None:
                resolved = cfg.resolved()
                run_stage_function("a", resolved.a)
                print(len("not the config"))
            """,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "route.py"), "--root", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    m = json.loads(out.stdout)
    assert [(s["to"], s["climb"], s["again"]) for s in m["route"]] == [
        ("eagle3.pipeline:run_pipeline", False, False),
        ("eagle3.config:PipelineConfig.resolved", False, False),
        ("eagle3.stages:run_stage_function", True, False),  # back up from config
        ("eagle3.stage_a:run_a", False, False),  # the function the registry looked up
        ("eagle3.config:StageConfig.require", False, False),
        ("eagle3.stage_a:helper", True, False),
        ("eagle3.stage_a:helper", False, True),  # a second stop, not walked again
    ]
    assert (m["num_stops"], m["num_modules"], m["num_visits"], m["num_climbs"]) == (7, 4, 6, 2)
    assert m["visits"]["eagle3.stage_a"] == 2
    assert (m["head"]["num_stops"], m["head"]["num_climbs"]) == (3, 1)


COPIED = textwrap.dedent("""
    def {name}(rows, limit):
        total = 0
        for row in rows:
            if row["{key}"] > limit:
                total += row["{key}"] * {n}
            else:
                total -= len(row)
        return total
    """)


def test_repeated_code_pairs(tmp_path):
    """A block copied with other names, strings and numbers is one pair, however long; a block of
    five lines, or a list of fields of one shape, is none."""
    fields = "class A:\n" + "".join(f"    f{i}: int = {i}\n" for i in range(12))
    write_checkout(
        tmp_path,
        {
            "pyproject.toml": PYPROJECT,
            "src/eagle3/config.py": "",
            "src/eagle3/a.py": COPIED.format(name="add", key="size", n=2) + fields,
            "src/eagle3/b.py": COPIED.format(name="weigh", key="cost", n=7) + fields,
            "tests/c.py": "\n".join(COPIED.format(name="f", key="k", n=1).splitlines()[:6]),
        },
    )
    m = measure(tmp_path)
    assert [(p["lines"], p["a"], p["b"]) for p in m["repeated_pairs"]] == [
        (8, "src/eagle3/a.py:2", "src/eagle3/b.py:2")
    ]
    assert m["num_repeated_pairs"] == m["num_repeated_pairs_library"] == 1
