"""scripts/structure.py (the structure figures in docs/structure.md) counts what it says, on a
checkout built here: long functions, `# noqa` comments, imports against the library's layers."""

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


def test_structure_counts_a_checkout(tmp_path):
    files = {
        "pyproject.toml": """
            [[tool.importlinter.contracts]]
            id = "library-layers"
            type = "layers"
            containers = ["eagle3"]
            layers = ["cli", "stage_a | stage_b", "config : io"]
            """,
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
        "src/eagle3/io.py": "from eagle3.config import f\n",
        "flows/pipeline.py": body(80, "flow") + "import os  # noqa: F401\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure.py"), "--root", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    m = json.loads(out.stdout)
    assert m["modules"] == {"library": 7, "prefect": 1}
    assert [(f["lines"], f["where"]) for f in m["long_functions"]] == [
        (80, "flows/pipeline.py:1 flow"),
        (61, "src/eagle3/stage_a/run.py:1 go"),
    ]
    assert m["num_noqa"] == 2 and m["num_library_layers"] == 3
    assert m["upward_imports"] == ["eagle3.config -> eagle3.cli"]
    assert m["sideways_imports"] == ["eagle3.stage_b -> eagle3.stage_a.run.go"]
