"""The package installs under its own names: the library as `eagle3`, the Prefect layer's top-level
directories as `eagle3_prefect.flows` / `.tasks` / `.blocks`, nothing else at the top of
site-packages; the stage registry is the one list of stages; `eagle3 run` finds the Prefect flow
through an entry point."""

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PREFECT_LAYER = ("flows", "tasks", "blocks")


def test_every_package_is_listed_under_our_names():
    setup = PYPROJECT["tool"]["setuptools"]
    listed = set(setup["packages"])
    src = ROOT / "src"
    library = {
        ".".join(p.parent.relative_to(src).parts) for p in (src / "eagle3").rglob("__init__.py")
    }
    # data directories (no __init__.py, files other than Python caches): setuptools drops those not
    # listed
    library |= {
        ".".join(d.relative_to(src).parts)
        for d in (src / "eagle3").rglob("*")
        if d.is_dir()
        and d.name != "__pycache__"
        and not (d / "__init__.py").exists()
        and any(f.is_file() for f in d.iterdir())
    }
    layer = {f"eagle3_prefect.{d}" for d in PREFECT_LAYER}
    assert listed == library | layer, (
        f"pyproject.toml [tool.setuptools] packages: add {library - listed}, drop "
        f"{listed - library - layer}"
    )
    assert {p.split(".")[0] for p in listed} == {
        "eagle3",
        "eagle3_prefect",
    }  # no top-level flows / tasks / blocks
    assert setup["package-dir"] == {"": "src", **{f"eagle3_prefect.{d}": d for d in PREFECT_LAYER}}
    for d in PREFECT_LAYER:
        assert not list((ROOT / d).rglob("*/__init__.py")), (
            f"{d}/ has a subpackage: list it in pyproject.toml"
        )


def test_the_prefect_layer_imports_from_this_checkout():
    """Tests of this checkout must exercise this checkout's flows (not another install's)."""
    for d in PREFECT_LAYER:
        mod = importlib.import_module(f"eagle3_prefect.{d}")
        assert Path(mod.__file__).resolve().parent == ROOT / d, (
            f"eagle3_prefect.{d} imports from {mod.__file__}, not {ROOT / d}: run `pip install -e "
            ".` in this checkout (or put a directory with eagle3_prefect/{flows,tasks,blocks} "
            "links to it on PYTHONPATH)"
        )


def test_eagle3_run_finds_the_prefect_flow_by_entry_point():
    from prefect import Flow

    from eagle3.pipeline import RUNNER_GROUP, find_runner
    from eagle3_prefect.flows.pipeline import eagle3_pipeline

    assert PYPROJECT["project"]["entry-points"][RUNNER_GROUP] == {
        "prefect": "eagle3_prefect.flows.pipeline:eagle3_pipeline"
    }
    runner = find_runner("prefect")
    assert isinstance(runner, Flow) and runner is eagle3_pipeline


def test_one_stage_registry():
    """The CLI commands, the pipeline order, the Prefect tasks and GPU flows all come from
    eagle3.stages."""
    from eagle3.cli import build_parser
    from eagle3.config import PipelineConfig
    from eagle3.pipeline import STAGE_ORDER, STREAM_ORDER
    from eagle3.stages import STAGES, stage_function, stage_names
    from eagle3_prefect.flows import gpu_stages
    from eagle3_prefect.tasks.stages import GPU_STAGES, STAGE_TASKS, SUBPROCESS_STAGES

    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(STAGES) <= set(commands)
    assert STAGE_ORDER == stage_names("pipeline")
    assert set(STAGE_ORDER) <= set(
        PipelineConfig.model_fields
    )  # every pipeline stage is a config section
    assert STREAM_ORDER == (
        "synthesize",
        "mix",
        "regenerate",
        "prepare",
        "vocab",
        "stream",
        "refine",
        "export",
        "evaluate",
    )
    assert set(STAGE_TASKS) == set(STAGES) - set(stage_names("stream"))
    assert GPU_STAGES == ("regenerate", "capture", "train", "refine", "evaluate")
    assert set(SUBPROCESS_STAGES) == {*GPU_STAGES, "synthesize"}
    for name, stage in STAGES.items():
        assert callable(stage_function(name)), name
        assert all(
            n in STAGES and list(STAGES).index(n) < list(STAGES).index(name) for n in stage.needs
        ), name
        flow = getattr(gpu_stages, f"{name}_stage", None)
        assert (flow is not None) == stage.gpu, name
        if flow is not None:
            assert flow.name == f"eagle3-{name}"
