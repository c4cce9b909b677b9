"""The eagle3 pipeline as a Prefect flow. The flow parameter is the PipelineConfig itself, so the
Prefect UI renders the whole config as a form and validates it before anything runs.

    eagle3 run --config configs/demo.yaml       # embedded local API, every stage in this
                                                # process tree
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, State

from eagle3.config import PipelineConfig
from eagle3.pipeline import enabled_stages, ensure_target
from eagle3.preflight import require_pipeline
from eagle3.stages import STAGES, STREAM_STEP, stage_names
from eagle3_prefect.flows.dispatch import DEFAULT_GPU_POOL, Dispatch, StageRunner, absolute_config
from eagle3_prefect.flows.report import pipeline_summary, run_namer
from eagle3_prefect.flows.runlock import work_dir_lock
from eagle3_prefect.tasks.artifacts import artifact_key
from eagle3_prefect.tasks.manifest import content_sha256, list_outputs


def apply_blocks(
    config: PipelineConfig, target_source: str | None, storage: str | None, hardware: str | None
) -> tuple[PipelineConfig, str, str | None]:
    """Fill the config from named blocks (blocks/eagle3_blocks.py); returns (config, GPU pool, GPU
    limit)."""
    pool, limit = DEFAULT_GPU_POOL, None
    if not (target_source or storage or hardware):
        return config, pool, limit
    from eagle3_prefect.blocks.eagle3_blocks import (
        HardwareProfile,
        StorageLocation,
        TargetModelSource,
    )

    cfg = config.model_copy(deep=True)
    if storage:
        cfg = StorageLocation.load(storage).apply(cfg)
    if target_source:
        cfg.target = TargetModelSource.load(target_source).resolve(cfg.work_dir / "target-snapshot")
    if hardware:
        profile = HardwareProfile.load(hardware)
        pool, limit = profile.work_pool, profile.gpu_concurrency_limit
        for name in stage_names("pipeline"):  # every stage that runs an engine of the target
            if "tensor_parallel_size" in type(getattr(cfg, name)).model_fields:
                getattr(cfg, name).tensor_parallel_size = profile.tensor_parallel_size
    return cfg, pool, limit


@flow(name="eagle3-pipeline", log_prints=True, flow_run_name=run_namer())
def eagle3_pipeline(
    config: PipelineConfig,
    dispatch: Dispatch = "auto",
    target_source: str | None = None,
    storage: str | None = None,
    hardware: str | None = None,
) -> State:
    """regenerate (optional) → prepare → capture → vocab → train → refine (optional) → export →
    evaluate.

    dispatch: "auto" runs GPU stages as their own deployments when a Prefect server has them, else
    here; "local" always here; "deployments" always as deployments. target_source / storage /
    hardware name blocks (TargetModelSource, StorageLocation, HardwareProfile) that override the
    config. Returns {stage: manifest} (its state's result); the run is named "<config name> ·
    <local time>" and its Completed state's message is the result in one line
    (flows/report.result_line: tokens per target step and τ, draft vs n-gram, the draft's path).

    One pipeline per work dir: the run holds <work_dir>/.eagle3.lock (eagle3.lock; released when the
    process ends, crash included) and a second run on the same work dir fails at once, naming the
    flow run that holds it. A run that takes over from a lost one closes it and says so in its
    summary. The config is checked (eagle3.preflight) before any stage starts: a bad value fails the
    run, naming the field, the value and the fix, before a GPU is taken.
    """
    config, gpu_pool, gpu_limit = apply_blocks(config, target_source, storage, hardware)
    config = absolute_config(config)
    with work_dir_lock(config.work_dir, "pipeline work_dir") as takeover:
        return run_stages(config, dispatch, gpu_pool, gpu_limit, takeover)


def stream_manifest(cfg: PipelineConfig, name: str, result: Any) -> dict[str, Any]:
    """The manifest of a stage whose output a stream variant wrote (its readers' upstream: the
    output keyed by its content)."""
    out = getattr(cfg, name).out
    files = list_outputs(out)
    return {
        "stage": name,
        "out": str(out),
        "content_sha256": content_sha256(files),
        "num_files": len(files),
        "result": result,
    }


def run_stages(
    config: PipelineConfig,
    dispatch: Dispatch,
    gpu_pool: str,
    gpu_limit: str | None,
    takeover: dict[str, Any] | None = None,
) -> State:
    """The stages in order (the work dir is locked); the config is checked once the target is there.
    takeover: the lost run this one took the work dir over from (its summary says so)."""
    cfg = config.resolved()
    stage = StageRunner(cfg, dispatch=dispatch, gpu_pool=gpu_pool, gpu_limit=gpu_limit)
    for name in stage_names("source"):  # 0. a known target into `target` (eagle3 fetch-target)
        if (source := config.stage_config(name)) is not None:
            stage(name, config=source)
    ensure_target(config)
    require_pipeline(config)  # pre-flight: every config error before a GPU stage starts

    # the declaration's order (eagle3.stage_graph), as `eagle3 run --no-prefect`
    for step in enabled_stages(cfg):
        if step == STREAM_STEP:  # bounded disk: the stream variants at once through the spool
            from eagle3_prefect.flows.streaming import streaming

            results = streaming(config)
            for name in stage_names("stream"):
                if not STAGES[name].writes:  # writes the output of the stage it stands for (train)
                    stage.manifests[STAGES[name].variant_of] = stream_manifest(
                        cfg, STAGES[name].variant_of, results[name]
                    )
        else:
            stage(step, *STAGES[step].needs)  # on the manifests of the stages it reads

    line = pipeline_summary(
        cfg.name,
        stage.manifests,
        key=artifact_key(cfg.name, "pipeline"),
        takeover=takeover,
        title=flow_run.name,
    )
    ran = [s for s, m in stage.manifests.items() if not m.get("cached")]
    get_run_logger().info(
        "pipeline %s: ran %s, cached %s; %s",
        cfg.name,
        ran or "nothing",
        [s for s in stage.manifests if s not in ran] or "nothing",
        line,
    )
    # the run page shows this message beside its state: the result without a click
    return Completed(message=line, data=stage.manifests)
