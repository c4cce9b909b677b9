"""The GPU-heavy stages as flows of their own, deployed on hardware-tagged work pools (prefect.yaml:
"eagle3-capture/subflow · capture · gpu-1x", "eagle3-train/subflow · train · gpu-8x", ...). The
pipeline flow launches them with `run_deployment` (tasks/dispatch.py); each runs the same cached,
verified stage task a local run uses. Parameters are the stage's own config model, so the UI shows a
form for a one-off stage run too.

One flow per stage the declaration marks `gpu` (eagle3.stage_graph), named `<stage>_stage` here (the
prefect.yaml entrypoints, e.g. eagle3_prefect.flows.gpu_stages:capture_stage) and `eagle3-<stage>`
on the server.
"""

from typing import Any

from prefect import Flow, flow

from eagle3.stages import STAGES, config_class
from eagle3_prefect.tasks.stages import GPU_STAGES, run_stage

Upstream = dict[str, dict[str, Any]]


def stage_flow(stage: str) -> Flow:
    """The flow `eagle3-<stage>`: runs the stage's task on this worker; its `config` parameter is
    typed by the stage's config class (the server validates it against that schema)."""

    def body(
        config,
        upstream: Upstream | None = None,
        run_name: str = "eagle3",
        cache_dir: str | None = None,
    ) -> dict[str, Any]:
        # a lost run of this flow is set Crashed by the server (Prefect's heartbeats,
        # blocks/alerts.py) and run again by its parent (tasks/dispatch.py); cache_dir: where the
        # parent keeps its cache records
        return run_stage(stage, config, upstream, run_name=run_name, cache_dir=cache_dir)

    body.__annotations__["config"] = config_class(stage)
    body.__name__ = body.__qualname__ = f"{stage}_stage"
    body.__module__ = __name__
    body.__doc__ = f"{stage} on a GPU pool: {STAGES[stage].help}."
    return flow(body, name=f"eagle3-{stage}", log_prints=True)


for _stage in GPU_STAGES:
    globals()[f"{_stage}_stage"] = stage_flow(_stage)
