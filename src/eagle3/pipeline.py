"""The whole pipeline in the order of the stage declaration (eagle3.stage_graph). `eagle3 run`
hands the config to the orchestration layer that registers itself as a pipeline runner (the Prefect
flow, eagle3_prefect.flows.pipeline, which adds caching, retries and artifacts) when installed;
`run_pipeline` is the same sequence in-process, with no orchestration, for machines without Prefect
(e.g. a bare GPU box) and for `eagle3 run --no-prefect`.

The library never imports the layer above it: the Prefect layer declares its runner as an entry
point (group `eagle3.pipeline_runners` in pyproject.toml) and this module finds it by that name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig, load_pipeline_config
from eagle3.console import StageLine, format_summary, summary_rows
from eagle3.io import write_json
from eagle3.lock import dir_lock
from eagle3.stages import STREAM_STEP, jsonable, pipeline_order, run_stage_function
from eagle3.targets import run_fetch_target
from eagle3.testing.tiny import TinySpec, build_tiny_target

log = logging.getLogger("eagle3.pipeline")

STAGE_ORDER = pipeline_order(streaming=False)
#: stream.enabled (bounded disk): vocab first, then capture + train at once through the spool
#: (eagle3.stream)
STREAM_ORDER = pipeline_order(streaming=True)

#: entry point group of pipeline runners: `name = "module:function"`, the function taking a
#: PipelineConfig
RUNNER_GROUP = "eagle3.pipeline_runners"


@dataclass
class PipelineResult:
    name: str
    work_dir: Path
    stages: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


def ensure_target(cfg: PipelineConfig) -> None:
    """Put the target in place: fetch the registry target `fetch_target` names into `target` (reused
    when already there), or (demo only) build the tiny random target when it does not exist yet."""
    if (fetch := cfg.fetch_target_config()) is not None:
        run_fetch_target(fetch)
    if cfg.build_tiny_target and not (Path(cfg.target) / "config.json").is_file():
        build_tiny_target(cfg.target, TinySpec())


def enabled_stages(cfg: PipelineConfig) -> list[str]:
    """The steps `eagle3 run` takes for this config, in order (PipelineConfig.steps: each stage's
    `enabled` in eagle3.stage_graph)."""
    return cfg.steps()


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    with dir_lock(
        cfg.work_dir, "pipeline work dir"
    ):  # one pipeline per work dir (re-entrant: see lock.py)
        return _run_pipeline(cfg)


def _run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    ensure_target(cfg)
    stages, resolved = cfg.steps(), cfg.resolved()  # the steps in order, each on its section
    result = PipelineResult(name=cfg.name, work_dir=cfg.work_dir)
    for i, stage in enumerate(stages, start=1):
        t0 = time.time()
        log.info("stage %s: starting", stage)
        with StageLine(stage, i, len(stages)) as line:  # the one progress line per stage
            if stage == STREAM_STEP:
                from eagle3.stream import run_stream  # torch, the capture and training sides

                result.stages[stage] = run_stream(cfg)
            else:
                result.stages[stage] = run_stage_function(stage, getattr(resolved, stage))
            result.wall_s[stage] = round(time.time() - t0, 2)
            line.done(result.stages[stage], wall_s=result.wall_s[stage])
        log.info("stage %s: done in %.1f s", stage, result.wall_s[stage])
    return result


def find_runner(name: str = "prefect") -> Callable[[PipelineConfig], Any] | None:
    """The pipeline runner an installed orchestration layer registered under `name` in RUNNER_GROUP,
    or None (with a warning saying why) when there is none or it cannot load (e.g. Prefect not
    installed)."""
    found = entry_points(group=RUNNER_GROUP, name=name)
    if not found:
        log.warning(
            "no %r pipeline runner is registered (entry point group %s; the Prefect layer declares "
            "it in pyproject.toml: reinstall with `pip install -e .`); running the stages "
            "in-process",
            name,
            RUNNER_GROUP,
        )
        return None
    ep = next(iter(found))
    try:
        return ep.load()
    except ImportError as e:
        if "prefect" not in str(e):
            raise
        log.warning("Prefect layer not available (%s); running the stages in-process", e)
        return None


def run_pipeline_from_file(path: str | Path, use_prefect: bool = True) -> Any:
    cfg = load_pipeline_config(path)
    runner = find_runner("prefect") if use_prefect else None
    if runner is None:
        return run_pipeline(cfg)

    with dir_lock(cfg.work_dir, "pipeline work dir"):
        return runner(cfg)


def summarize_run(config_path: str | Path, result: Any) -> str:
    """The table `eagle3 run` ends on (eagle3.console.format_summary), after writing the full result
    (every stage's manifest or result) to <work_dir>/run_summary.json."""
    cfg = load_pipeline_config(config_path)
    if isinstance(result, PipelineResult):
        stages, wall_s, prefect = result.stages, result.wall_s, False
    else:
        stages, wall_s, prefect = dict(result), None, True
    work = Path(cfg.work_dir)
    where: dict[str, str] = {}
    if work.is_dir():
        full = work / "run_summary.json"
        write_json(full, jsonable({"config": str(config_path), "stages": stages, "wall_s": wall_s}))
        where["details"] = str(full)
        plots = sorted(str(p) for p in work.rglob("*.png"))
        if plots:
            where["plots"] = ", ".join(plots[:6]) + (
                f" (+{len(plots) - 6} more)" if len(plots) > 6 else ""
            )
    if "export" in stages:
        where["draft"] = (
            f'{cfg.resolved().export.out}  (vLLM: speculative_config={{"method": "eagle3", '
            '"model": ...})'
        )
    if prefect:
        where["prefect"] = (
            "artifacts of this run (summary, curves, τ) in the local Prefect database: "
            f"`prefect artifact ls`, or `prefect server start` and its UI at "
            f"/artifacts/key/{cfg.name}-pipeline"
        )
    return format_summary(cfg.name, summary_rows(stages, wall_s), work, where)
