"""A stage's code version follows its real imports (eagle3.code_version): an edit to a module it
reaches, however indirectly, changes it; an edit elsewhere leaves it alone. Each test edits a copy
of the package, never the checkout."""

from __future__ import annotations

import importlib.metadata
import shutil
import textwrap
from pathlib import Path

import pytest

from eagle3.code_version import (
    code_version,
    external_packages,
    import_closure,
    package_root,
)
from eagle3.stages import STAGES


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """A copy of the eagle3 package's sources (what the code version reads)."""
    root = tmp_path / "eagle3"
    shutil.copytree(package_root(), root, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    return root


def edit(path: Path) -> None:
    """A change that alters no behaviour: enough for the sources to differ."""
    path.write_text(path.read_text() + "\n# edited\n")


def versions(root: Path) -> dict[str, str]:
    return {name: stage.code_version(root) for name, stage in STAGES.items()}


def closure(stage: str) -> set[str]:
    s = STAGES[stage]
    return set(import_closure((s.function.split(":")[0], s.config_ref[0])))


def test_evaluate_follows_the_engine_and_the_draft_model_it_reaches_indirectly(package_copy):
    before = versions(package_copy)
    assert versions(package_copy) == before  # stable while nothing changes
    # eagle3.evaluate imports vllm_engine; eagle3.model.draft only through eagle3.integrity
    assert {"eagle3.vllm_engine", "eagle3.vllm_ext", "eagle3.model.draft"} <= closure("evaluate")
    assert not {"eagle3.vllm_engine", "eagle3.model.draft"} & closure("prepare")
    for module in ("vllm_engine.py", "model/draft.py"):
        edit(package_copy / module)
        after = versions(package_copy)
        assert after["evaluate"] != before["evaluate"], module
        assert after["prepare"] == before["prepare"], module
        assert after["vocab"] == before["vocab"], module
        before = after


def test_capture_follows_its_engine_child_and_the_vllm_hooks(package_copy):
    """capture/engine_main.py runs as `python -m eagle3.capture.engine_main` (no import reaches
    it); vllm_ext.py through the vLLM backend."""
    before = versions(package_copy)
    assert {"eagle3.capture.engine_main", "eagle3.vllm_ext"} <= closure("capture")
    for module in ("capture/engine_main.py", "vllm_ext.py"):
        edit(package_copy / module)
        after = versions(package_copy)
        assert after["capture"] != before["capture"], module
        assert after["stream-capture"] != before["stream-capture"], module
        assert after["prepare"] == before["prepare"], module
        assert after["mix"] == before["mix"], module
        before = after
    edit(package_copy / "evaluate" / "run.py")  # another stage's own module
    after = versions(package_copy)
    assert after["capture"] == before["capture"] and after["evaluate"] != before["evaluate"]


def test_the_import_rules(tmp_path):
    """Module-level and function-level imports, relative ones, `from package import submodule`,
    packages' __init__, module names in strings; not `if TYPE_CHECKING:` imports."""
    root = tmp_path / "eagle3"
    files = {
        "__init__.py": "",
        "stage.py": """
            from typing import TYPE_CHECKING

            import numpy

            from eagle3.tools import helper

            if TYPE_CHECKING:
                from eagle3 import typing_only
            else:
                import eagle3.runtime_only

            EXTENSION = "eagle3.hooks.Extension"

            def run():
                from eagle3.lazy import thing

                return thing
            """,
        "tools/__init__.py": "from .base import BASE\n",
        "tools/base.py": "BASE = 1\n",
        "tools/helper.py": "from . import base\nfrom ..deep.inner import x\n",
        "deep/__init__.py": "",
        "deep/inner.py": "x = 1\n",
        "typing_only.py": "",
        "runtime_only.py": "",
        "hooks.py": "class Extension: ...\n",
        "lazy.py": "import torch.nn\nthing = 1\n",
        "unused.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    assert import_closure(["eagle3.stage"], root) == (
        "eagle3",
        "eagle3.deep",
        "eagle3.deep.inner",
        "eagle3.hooks",
        "eagle3.lazy",
        "eagle3.runtime_only",
        "eagle3.stage",
        "eagle3.tools",
        "eagle3.tools.base",
        "eagle3.tools.helper",
    )
    assert {"numpy", "torch", "triton"} <= set(external_packages(["eagle3.stage"], root))
    before = code_version(["eagle3.stage"], root)
    edit(root / "typing_only.py")
    edit(root / "unused.py")
    assert code_version(["eagle3.stage"], root) == before
    edit(root / "deep" / "inner.py")
    assert code_version(["eagle3.stage"], root) != before


def test_the_packages_that_shape_a_stages_output():
    """The versions of the installed distributions a stage imports, read from its imports:
    vLLM, torch and transformers for evaluate and capture; no vLLM for prepare."""
    for stage in ("evaluate", "capture"):
        s = STAGES[stage]
        found = external_packages((s.function.split(":")[0], s.config_ref[0]))
        assert {"torch", "transformers", "tokenizers"} <= found.keys(), found
        (vllm,) = [d for d in found if d.startswith("vllm")]
        assert found[vllm] == importlib.metadata.version(vllm)
        assert found["torch"] == importlib.metadata.version("torch")
    prepare = STAGES["prepare"]
    found = external_packages((prepare.function.split(":")[0], prepare.config_ref[0]))
    assert "transformers" in found and not [d for d in found if d.startswith("vllm")]
    assert "prefect" not in found  # the library never imports the Prefect layer
