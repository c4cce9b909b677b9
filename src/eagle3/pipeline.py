"""The whole pipeline in stage order. `eagle3 run` uses the Prefect flow (flows/pipeline.py) when Prefect
is installed, which adds caching, retries and artifacts; `run_pipeline` is the same sequence in-process,
with no orchestration, for machines without Prefect (e.g. a bare GPU box).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig, load_pipeline_config
from eagle3.console import StageLine

log = logging.getLogger("eagle3.pipeline")

STAGE_ORDER = ("synthesize", "mix", "regenerate", "prepare", "capture", "vocab", "train", "export", "evaluate")
#: stream.enabled (bounded disk): vocab first, then capture + train at once through the spool (eagle3.stream)
STREAM_ORDER = ("synthesize", "mix", "regenerate", "prepare", "vocab", "stream", "export", "evaluate")


@dataclass
class PipelineResult:
    name: str
    work_dir: Path
    stages: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


def ensure_target(cfg: PipelineConfig) -> None:
    """Put the target in place: fetch the registry target `fetch_target` names into `target` (reused when
    already there), or (demo only) build the tiny random target when it does not exist yet."""
    if (fetch := cfg.fetch_target_config()) is not None:
        from eagle3.targets import run_fetch_target

        run_fetch_target(fetch)
    if cfg.build_tiny_target and not (Path(cfg.target) / "config.json").is_file():
        from eagle3.testing.tiny import TinySpec, build_tiny_target

        build_tiny_target(cfg.target, TinySpec())


def enabled_stages(cfg: PipelineConfig) -> list[str]:
    stages = []
    for s in STREAM_ORDER if cfg.stream.enabled else STAGE_ORDER:
        if s == "regenerate" and not cfg.regenerate.enabled:
            continue
        if s == "synthesize" and not cfg.synthesize.enabled:
            continue
        if s == "mix" and len(cfg.mix_sources()) < 2:
            continue
        if s == "evaluate" and not cfg.eval_prompts:
            continue
        stages.append(s)
    return stages


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    from eagle3.lock import dir_lock

    with dir_lock(cfg.work_dir, "pipeline work dir"):  # one pipeline per work dir (re-entrant: see lock.py)
        return _run_pipeline(cfg)


def _run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    from eagle3.cli import resolve_function

    ensure_target(cfg)
    resolved = cfg.resolved()
    result = PipelineResult(name=cfg.name, work_dir=cfg.work_dir)
    stages = enabled_stages(cfg)
    for i, stage in enumerate(stages, start=1):
        t0 = time.time()
        log.info("stage %s: starting", stage)
        with StageLine(stage, i, len(stages)) as line:  # the one progress line per stage
            if stage == "stream":
                from eagle3.stream import run_stream

                result.stages[stage] = run_stream(cfg)
            else:
                result.stages[stage] = resolve_function(stage)(getattr(resolved, stage))
            result.wall_s[stage] = round(time.time() - t0, 2)
            line.done(result.stages[stage], wall_s=result.wall_s[stage])
        log.info("stage %s: done in %.1f s", stage, result.wall_s[stage])
    return result


def run_pipeline_from_file(path: str | Path, use_prefect: bool = True) -> Any:
    cfg = load_pipeline_config(path)
    if use_prefect:
        try:
            from flows.pipeline import eagle3_pipeline
        except ImportError as e:
            if "prefect" not in str(e) and "flows" not in str(e):
                raise
            log.warning("Prefect layer not available (%s); running the stages in-process", e)
        else:
            from eagle3.lock import dir_lock

            with dir_lock(cfg.work_dir, "pipeline work dir"):
                return eagle3_pipeline(cfg)
    return run_pipeline(cfg)


def summarize_run(config_path: str | Path, result: Any) -> str:
    """The table `eagle3 run` ends on (eagle3.console.format_summary), after writing the full result (every
    stage's manifest or result) to <work_dir>/run_summary.json."""
    from eagle3.cli import _jsonable
    from eagle3.console import format_summary, summary_rows
    from eagle3.io import write_json

    cfg = load_pipeline_config(config_path)
    if isinstance(result, PipelineResult):
        stages, wall_s, prefect = result.stages, result.wall_s, False
    else:
        stages, wall_s, prefect = dict(result), None, True
    work = Path(cfg.work_dir)
    where: dict[str, str] = {}
    if work.is_dir():
        full = work / "run_summary.json"
        write_json(full, _jsonable({"config": str(config_path), "stages": stages, "wall_s": wall_s}))
        where["details"] = str(full)
        plots = sorted(str(p) for p in work.rglob("*.png"))
        if plots:
            where["plots"] = ", ".join(plots[:6]) + (f" (+{len(plots) - 6} more)" if len(plots) > 6 else "")
    if "export" in stages:
        where["draft"] = f"{cfg.resolved().export.out}  (vLLM: speculative_config={{\"method\": \"eagle3\", \"model\": ...}})"
    if prefect:
        where["prefect"] = ("artifacts of this run (summary, curves, τ) in the local Prefect database: "
                            "`prefect artifact ls`, or `prefect server start` and its UI's Artifacts page")
    return format_summary(cfg.name, summary_rows(stages, wall_s), work, where)
