"""The eagle3 pipeline as a Prefect flow. The flow parameter is the PipelineConfig itself, so the
Prefect UI renders the whole config as a form and validates it before anything runs.

    eagle3 run --config configs/demo.yaml       # embedded local API, every stage in this process tree
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from tasks.artifacts import artifact_key
from tasks.manifest import content_sha256, list_outputs

from eagle3.config import PipelineConfig
from eagle3.pipeline import ensure_target
from flows.dispatch import DEFAULT_GPU_POOL, Dispatch, StageRunner
from flows.report import pipeline_summary


def apply_blocks(config: PipelineConfig, target_source: str | None, storage: str | None,
                 hardware: str | None) -> tuple[PipelineConfig, str, str | None]:
    """Fill the config from named blocks (blocks/eagle3_blocks.py); returns (config, GPU pool, GPU limit)."""
    pool, limit = DEFAULT_GPU_POOL, None
    if not (target_source or storage or hardware):
        return config, pool, limit
    from blocks.eagle3_blocks import HardwareProfile, StorageLocation, TargetModelSource

    cfg = config.model_copy(deep=True)
    if storage:
        cfg = StorageLocation.load(storage).apply(cfg)
    if target_source:
        cfg.target = TargetModelSource.load(target_source).resolve(cfg.work_dir / "target-snapshot")
    if hardware:
        profile = HardwareProfile.load(hardware)
        pool, limit = profile.work_pool, profile.gpu_concurrency_limit
        for stage in ("regenerate", "capture", "evaluate"):
            getattr(cfg, stage).tensor_parallel_size = profile.tensor_parallel_size
    return cfg, pool, limit


@flow(name="eagle3-pipeline", log_prints=True)
def eagle3_pipeline(
    config: PipelineConfig,
    dispatch: Dispatch = "auto",
    target_source: str | None = None,
    storage: str | None = None,
    hardware: str | None = None,
) -> dict[str, Any]:
    """prepare → regenerate (optional) → capture → vocab → train → export → evaluate.

    dispatch: "auto" runs GPU stages as their own deployments when a Prefect server has them, else
    here; "local" always here; "deployments" always as deployments. target_source / storage / hardware
    name blocks (TargetModelSource, StorageLocation, HardwareProfile) that override the config.
    Returns {stage: manifest}.
    """
    config, gpu_pool, gpu_limit = apply_blocks(config, target_source, storage, hardware)
    cfg = config.resolved()
    stage = StageRunner(cfg, dispatch=dispatch, gpu_pool=gpu_pool, gpu_limit=gpu_limit)
    if config.fetch_target:                        # 0. a known target into `target` (eagle3 fetch-target)
        stage("fetch-target", config=config.fetch_target_config())
    ensure_target(config)

    if cfg.regenerate.enabled:
        stage("regenerate")                        # 1. the target writes the answers (on-policy data)
    stage("prepare")                               # 2. chats -> token ids + assistant loss masks
    #   (after regenerate, prepare's `data` is regenerated/conversations.jsonl: keyed by that file's
    #    content, so a regenerate rerun that writes the same answers leaves prepare cached)
    if cfg.stream.enabled:                         # bounded disk: 4. vocab, then 3 + 5 at once via the spool
        from flows.streaming import streaming

        stage("vocab", "prepare")
        result = streaming(config)["stream-train"]  # export's upstream: the training dir, keyed by its content
        files = list_outputs(cfg.train.out)
        stage.manifests["train"] = {"stage": "train", "out": str(cfg.train.out), "content_sha256": content_sha256(files),
                                    "num_files": len(files), "result": result}
    else:
        stage("capture", "prepare")                # 3. aux + last hidden states of the target
        stage("vocab", "prepare")                  # 4. draft vocabulary (d2t / t2d)
        stage("train", "capture", "vocab")         # 5. the EAGLE-3 draft
    stage("export", "train")                       # 6. a directory vLLM loads
    if cfg.eval_prompts:
        stage("evaluate", "export")                # 7. τ in real vLLM

    pipeline_summary(cfg.name, stage.manifests, key=artifact_key(cfg.name, "pipeline"))
    ran = [s for s, m in stage.manifests.items() if not m.get("cached")]
    get_run_logger().info("pipeline %s: ran %s, cached %s", cfg.name, ran or "nothing",
                          [s for s in stage.manifests if s not in ran] or "nothing")
    return stage.manifests
