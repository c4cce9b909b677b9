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
    for stage in enabled_stages(cfg):
        t0 = time.time()
        log.info("stage %s: starting", stage)
        if stage == "stream":
            from eagle3.stream import run_stream

            result.stages[stage] = run_stream(cfg)
        else:
            result.stages[stage] = resolve_function(stage)(getattr(resolved, stage))
        result.wall_s[stage] = round(time.time() - t0, 2)
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
