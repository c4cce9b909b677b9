"""Several drafts trained side by side, one GPU each: `train_grid` runs one `train` stage per config
(e.g. each method on each training set, as benchmarks/realbench trains its grid) and compares their
final metrics.

With deployments (dispatch auto on a server, or "deployments") every draft is a flow run of
`eagle3-train/subflow · train · <pool>`; start one gpu-1x worker per GPU, each with its own
CUDA_VISIBLE_DEVICES and a per-device slot (EAGLE3_GPU_LIMIT="gpu-host-{host}-gpu{device}",
tasks/stages.gpu_limit_names), and the drafts train one per GPU at once (docs/scaling.md, "Prefect
pools and deployments"). Locally (dispatch "local") they run in this flow run's threads. Each
draft's capture and vocab are named in its own config; they count in its cache key by the stamps of
the stages that wrote them (or by content when no stage stamped them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from eagle3.config import ConfigError, TrainConfig
from eagle3_prefect.flows.dispatch import (
    DEFAULT_GPU_POOL,
    Dispatch,
    api_configured,
    deployment_exists,
    stage_deployment,
)
from eagle3_prefect.tasks.manifest import fingerprint_path, read_stamp
from eagle3_prefect.tasks.stages import run_stage


def train_inputs(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The train stage's upstream entries for a config given whole: the capture dir(s) and the vocab
    dir, by the content hash their stage stamped, or by content."""
    upstream = {}
    for name, path in (("capture", cfg.captured), ("vocab", cfg.vocab)):
        if path is None:
            continue
        stamp = read_stamp(path) if "," not in str(path) else None
        done = stamp is not None and stamp.get("status") == "done"
        digest = (
            stamp["content_sha256"]
            if done
            else "|".join(fingerprint_path(p) for p in str(path).split(","))
        )
        upstream[name] = {"out": str(path), "content_sha256": digest}
    return upstream


@task(name="grid-draft", cache_policy=NONE, task_run_name="draft {name}")
def train_one(name: str, cfg: TrainConfig, deployment: str | None, run_name: str) -> dict[str, Any]:
    m = run_stage(
        "train", cfg, train_inputs(cfg), run_name=f"{run_name}-{name}", deployment=deployment
    )
    result = m.get("result") or {}
    return {
        "name": name,
        "out": m["out"],
        "cached": bool(m.get("cached")),
        "wall_s": m.get("wall_s"),
        "slot_wait_s": m.get("slot_wait_s"),
        "steps": result.get("steps"),
        "train_loss": result.get("train_loss"),
        "val_metrics": result.get("val_metrics") or {},
    }


@flow(name="eagle3-train-grid", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def train_grid(
    runs: Annotated[dict[str, TrainConfig], Field(min_length=1)],
    dispatch: Dispatch = "auto",
    gpu_pool: str = DEFAULT_GPU_POOL,
    run_name: str = "grid",
) -> dict[str, Any]:
    """Train every draft of `runs` ({name: train config}) at once; returns {"rows": [...]} in the
    order given, each with its out dir, steps, final train loss, validation metrics, wall and
    GPU-slot wait seconds."""
    if not runs:
        raise ConfigError(
            "train_grid: runs = {}: name at least one draft, e.g. {'eagle3-mix': {...train "
            "config...}}"
        )
    outs = [str(Path(c.out).resolve()) for c in runs.values() if c.out is not None]
    if len(set(outs)) != len(outs):
        raise ConfigError(
            "train_grid: two drafts share an out dir "
            f"({sorted(o for o in outs if outs.count(o) > 1)}): give each draft its own train.out"
        )
    name = stage_deployment("train", gpu_pool)
    use = dispatch == "deployments" or (
        dispatch == "auto" and api_configured() and deployment_exists(name)
    )
    deployment = name if use else None
    get_run_logger().info("train grid: %d drafts on %s", len(runs), deployment or "this flow run")
    futures = [train_one.submit(n, c, deployment, run_name) for n, c in runs.items()]
    return {"rows": [f.result() for f in futures]}
