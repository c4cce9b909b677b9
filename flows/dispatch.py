"""Where a stage runs: in this flow run (embedded default, CPU stages) or as a run of its GPU stage
deployment on a hardware-tagged work pool."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger

from eagle3.config import PipelineConfig, StageConfig
from eagle3.console import StageLine
from eagle3.pipeline import enabled_stages
from eagle3_prefect.tasks import artifacts
from eagle3_prefect.tasks.stages import GPU_STAGES, RESULT_DIR, run_stage

Dispatch = Literal["auto", "local", "deployments"]

DEFAULT_GPU_POOL = "gpu-1x"


def stage_deployment(stage: str, pool: str) -> str:
    """The full name of `stage`'s deployment on `pool` (prefect.yaml), e.g. "eagle3-train/subflow ·
    train · gpu-1x": named for what it is (a run the pipeline launches as its subflow) and where it
    runs, and sorted after the deployments a person starts (pipeline ... streaming) in the UI's
    list (A to Z)."""
    return f"eagle3-{stage}/subflow · {stage} · {pool}"


def absolute_config(config: PipelineConfig) -> PipelineConfig:
    """`config` with its work dir and inputs as absolute, resolved paths: every process of the run
    (a GPU stage on another worker, in another working directory) and every record (cache keys,
    stamps, artifacts) names the same files, and two checkouts that both say `runs/demo` never share
    outputs or cache entries."""
    c = config.model_copy(deep=True)
    c.work_dir = Path(c.work_dir).expanduser().resolve()
    for name in ("target", "data", "eval_prompts"):
        value = getattr(c, name)
        if value and "://" not in str(value):
            setattr(c, name, str(Path(value).expanduser().resolve()))
    return c


_checked_lost_run_automation: list[bool] = []


def check_lost_run_automation() -> None:
    """Warn (once per process) when the server lacks the automation that finds a lost GPU stage run:
    without it a run whose host dies stays Running and its parent waits for it."""
    if _checked_lost_run_automation:
        return
    _checked_lost_run_automation.append(True)
    from prefect.client.orchestration import get_client

    from eagle3_prefect.blocks.alerts import LOST_AUTOMATION_NAME

    try:
        with get_client(sync_client=True) as client:
            found = client.read_automations_by_name(LOST_AUTOMATION_NAME)
    except Exception:  # the check is advice, never a failure
        return
    if not found:
        get_run_logger().warning(
            "the automation %s is not on this server: a GPU stage run whose host or process is "
            "lost stays Running and this run waits for it. Create it: "
            "python -m eagle3_prefect.blocks.alerts (scripts/deploy.sh)",
            LOST_AUTOMATION_NAME,
        )


def api_configured() -> bool:
    """True when flows talk to a real Prefect server (not the embedded, ephemeral API)."""
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value() or os.environ.get("PREFECT_API_URL"))


def deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
        return True
    except Exception:  # ObjectNotFound or no server: run locally
        return False


@dataclass
class StageRunner:
    """Runs the stages of one pipeline config, remembering their manifests (in stage order)."""

    cfg: PipelineConfig
    dispatch: Dispatch = "auto"
    gpu_pool: str = DEFAULT_GPU_POOL
    gpu_limit: str | None = None
    run_name: str = ""
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    _deployments: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_name = self.run_name or self.cfg.name

    @property
    def cache_dir(self) -> Path:
        """Where the stage tasks keep their cache records: <work_dir>/.prefect-results
        (tasks/stages.py)."""
        return Path(self.cfg.work_dir) / RESULT_DIR

    def deployment_for(self, stage: str) -> str | None:
        if stage not in GPU_STAGES or self.dispatch == "local":
            return None
        if stage not in self._deployments:
            name = stage_deployment(stage, self.gpu_pool)
            if self.dispatch == "deployments":
                self._deployments[stage] = name
            else:
                self._deployments[stage] = (
                    name if api_configured() and deployment_exists(name) else None
                )
            where = self._deployments[stage] or "this flow run"
            get_run_logger().info("stage %s runs on %s", stage, where)
            if self._deployments[stage]:
                check_lost_run_automation()
        return self._deployments[stage]

    def __call__(
        self, stage: str, *needs: str, config: StageConfig | None = None
    ) -> dict[str, Any]:
        """Run `stage` on the outputs of the stages named in `needs`; return its manifest."""
        config = config if config is not None else getattr(self.cfg, stage)
        upstream = {n: self.manifests[n] for n in needs if n in self.manifests}
        index = len(self.manifests) + 1
        total = len(enabled_stages(self.cfg)) + bool(getattr(self.cfg, "fetch_target", None))
        with StageLine(stage, index, max(index, total)) as line:  # one progress line per stage
            m = run_stage(
                stage,
                config,
                upstream,
                run_name=self.run_name,
                deployment=self.deployment_for(stage),
                gpu_limit=self.gpu_limit,
                cache_dir=self.cache_dir,
            )
            line.done(
                m.get("result"),
                cached=bool(m.get("cached")),
                wall_s=None if m.get("cached") else m.get("wall_s"),
            )
        if m.get("cached") or m.get("deployment"):  # reports made elsewhere: this run's own
            artifacts.stage_reports(self.run_name, m)
        self.manifests[stage] = m
        return m
