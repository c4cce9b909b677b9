"""Where a stage runs: in this flow run (embedded default, CPU stages) or as a run of its GPU stage
deployment on a hardware-tagged work pool."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import get_run_logger

from eagle3.config import PipelineConfig, StageConfig
from eagle3.console import StageLine
from eagle3.pipeline import enabled_stages
from eagle3_prefect.tasks.stages import GPU_STAGES, run_stage

Dispatch = Literal["auto", "local", "deployments"]

#: GPU stage flows (flows/gpu_stages.py) by stage; their deployments are "<flow name>/<pool>"
STAGE_FLOW_NAMES = {s: f"eagle3-{s}" for s in GPU_STAGES}
DEFAULT_GPU_POOL = "gpu-1x"


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
    except Exception:  # noqa: BLE001 - ObjectNotFound or no server: run locally
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

    def deployment_for(self, stage: str) -> str | None:
        if stage not in GPU_STAGES or self.dispatch == "local":
            return None
        if stage not in self._deployments:
            name = f"{STAGE_FLOW_NAMES[stage]}/{self.gpu_pool}"
            if self.dispatch == "deployments":
                self._deployments[stage] = name
            else:
                self._deployments[stage] = name if api_configured() and deployment_exists(name) else None
            where = self._deployments[stage] or "this flow run"
            get_run_logger().info("stage %s runs on %s", stage, where)
        return self._deployments[stage]

    def __call__(self, stage: str, *needs: str, config: StageConfig | None = None) -> dict[str, Any]:
        """Run `stage` on the outputs of the stages named in `needs`; return its manifest."""
        config = config if config is not None else getattr(self.cfg, stage)
        upstream = {n: self.manifests[n] for n in needs if n in self.manifests}
        index = len(self.manifests) + 1
        total = len(enabled_stages(self.cfg)) + bool(getattr(self.cfg, "fetch_target", None))
        with StageLine(stage, index, max(index, total)) as line:  # one progress line per stage
            m = run_stage(stage, config, upstream, run_name=self.run_name, deployment=self.deployment_for(stage),
                          gpu_limit=self.gpu_limit)
            line.done(m.get("result"), cached=bool(m.get("cached")), wall_s=None if m.get("cached") else m.get("wall_s"))
        self.manifests[stage] = m
        return m
