"""Which target layers should feed the draft? `layer_sweep` shares the stages that do not read the
capture (synthesize, mix, regenerate, prepare, vocab: none depends on the layers; all cached across
sweeps) and fans out capture and every stage that reads it (train → refine → export → evaluate,
those the config enables; eagle3.stage_graph) per layer set, at most `max_concurrency` branches at a
time, then compares them and names the winner (highest τ; lowest final loss when there are no eval
prompts).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from eagle3.config import ConfigError, LayerId, PipelineConfig
from eagle3.pipeline import ensure_target
from eagle3.preflight import require_pipeline
from eagle3.stages import STAGES, downstream_of, pipeline_order
from eagle3_prefect.flows.dispatch import Dispatch, StageRunner, absolute_config
from eagle3_prefect.flows.report import run_namer
from eagle3_prefect.flows.runlock import work_dir_lock
from eagle3_prefect.tasks.artifacts import (
    artifact_key,
    find_per_position,
    find_tau,
    find_value,
    png_markdown,
)

#: the stages each branch runs on the shared outputs: capture and every stage that reads it
BRANCH_STAGES = downstream_of("capture")
_LOSS_KEYS = ("final_val_loss", "val_loss", "final_loss", "final_train_loss", "train_loss", "loss")


def layers_tag(layers: list[int]) -> str:
    return "layers-" + "-".join(str(i) for i in layers)


def branch_config(config: PipelineConfig, layers: list[int]) -> PipelineConfig:
    """The pipeline config of one branch: the shared stages' outputs, its own capture onwards (each
    branch stage writes under <work_dir>/sweep/<layers>/, and resolving reads them there)."""
    c = config.model_copy(deep=True)
    root = c.work_dir / "sweep" / layers_tag(layers)
    c.capture.aux_layer_ids = list(layers)
    for name in BRANCH_STAGES:
        section = getattr(c, name)
        section.out = root / STAGES[name].writes
        for field, source in STAGES[name].reads.items():
            if source.split("/")[0] in BRANCH_STAGES:  # resolved again: the branch's own output
                setattr(section, field, None)
    return c.resolved()


def find_loss(result: dict[str, Any]) -> float | None:
    v = find_value(
        result, _LOSS_KEYS, lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    )
    return None if v is None else float(v)


@task(name="sweep-branch", cache_policy=NONE, task_run_name="branch {layers}")
def sweep_branch(
    config: PipelineConfig,
    layers: list[int],
    shared: dict[str, dict[str, Any]],
    dispatch: Dispatch,
    slots: Any = None,
) -> dict[str, Any]:
    """capture → train → export → evaluate for one layer set, on the shared prepare/vocab
    outputs."""
    with slots or threading.Semaphore(1):
        cfg = branch_config(config, layers)
        stage = StageRunner(cfg, dispatch=dispatch, run_name=f"{cfg.name}-{layers_tag(layers)}")
        stage.manifests.update(shared)
        t0 = time.time()
        for step in BRANCH_STAGES:
            if cfg.runs(step):
                stage(step, *STAGES[step].needs)
        wall = time.time() - t0
    m = stage.manifests
    result = (m.get("evaluate") or {}).get("result") or {}
    return {
        "layers": list(layers),
        "tau": find_tau(result),
        "per_position_acceptance": find_per_position(result),
        "train_loss": find_loss(m["train"].get("result") or {}),
        # running time of the branch's stages; the wait for the GPU slot is apart (it is not stage
        # time)
        "stage_wall_s": round(
            sum(m[s]["wall_s"] for s in ("capture", "train", "export", "evaluate") if s in m), 1
        ),
        "slot_wait_s": round(
            sum(m[s].get("slot_wait_s") or 0.0 for s in ("capture", "train", "evaluate") if s in m),
            1,
        ),
        "this_run_wall_s": round(wall, 1),
        "cached": all(m[s].get("cached") for s in ("capture", "train", "export") if s in m),
        "draft": m["export"]["out"],
    }


def pick_winner(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest τ; ties (or no τ) by the lower train loss."""

    def score(r: dict[str, Any]) -> tuple[float, float]:
        tau = r["tau"] if r["tau"] is not None else float("-inf")
        loss = r["train_loss"] if r["train_loss"] is not None else float("inf")
        return (tau, -loss)

    return max(rows, key=score)


def comparison_chart(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Bar chart of τ (or train loss) per layer set, plus per-position acceptance curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [",".join(map(str, r["layers"])) for r in rows]
    metric = "tau" if any(r["tau"] is not None for r in rows) else "train_loss"
    values = [r[metric] if r[metric] is not None else 0.0 for r in rows]
    has_pos = any(r["per_position_acceptance"] for r in rows)
    fig, axes = plt.subplots(
        1, 2 if has_pos else 1, figsize=(10 if has_pos else 5, 3.5), squeeze=False
    )
    ax = axes[0][0]
    ax.bar(labels, values, color="tab:blue")
    ax.set_xlabel("aux layer ids")
    ax.set_ylabel("τ (mean acceptance length)" if metric == "tau" else "final train loss")
    ax.set_title("layer sweep")
    if has_pos:
        ax2 = axes[0][1]
        for label, r in zip(labels, rows, strict=True):
            if r["per_position_acceptance"]:
                ax2.plot(
                    range(1, len(r["per_position_acceptance"]) + 1),
                    r["per_position_acceptance"],
                    marker="o",
                    label=label,
                )
        ax2.set_xlabel("draft position")
        ax2.set_ylabel("acceptance rate")
        ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


@flow(
    name="eagle3-layer-sweep",
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=8),
    flow_run_name=run_namer("layer sweep"),
)
def layer_sweep(
    config: PipelineConfig,
    layer_sets: Annotated[list[Annotated[list[LayerId], Field(min_length=1)]], Field(min_length=1)],
    max_concurrency: Annotated[int, Field(ge=1)] = 1,
    dispatch: Dispatch = "auto",
) -> dict[str, Any]:
    """Train and evaluate one draft per aux layer set; returns {"winner": ..., "rows": [...]}.

    max_concurrency bounds the branches in flight (GPU stages of concurrent branches also queue on
    the per-host GPU concurrency limit when dispatched to GPU pools). The server checks both
    parameters' bounds itself (the schema); the flow checks the layer ids against the target before
    any stage."""
    if not layer_sets:
        raise ConfigError(
            "layer_sweep: layer_sets = []: name at least one layer set, e.g. [[1, 2, 3], [2, 3, 4]]"
        )
    if max_concurrency < 1:
        raise ConfigError(
            f"layer_sweep: max_concurrency = {max_concurrency}: use 1 or more (branches in flight)"
        )
    config = absolute_config(config)
    with work_dir_lock(config.work_dir, "layer sweep work_dir"):
        ensure_target(config)
        require_pipeline(config, layer_sets, what="layer sweep")
        return sweep(config, layer_sets, max_concurrency, dispatch)


def sweep(
    config: PipelineConfig, layer_sets: list[list[int]], max_concurrency: int, dispatch: Dispatch
) -> dict[str, Any]:
    """The sweep itself (the work dir is locked and the config checked)."""
    cfg = config.resolved()
    shared = StageRunner(cfg, dispatch=dispatch)
    for step in pipeline_order():  # the stages that do not read the capture, once for all branches
        if step not in BRANCH_STAGES and cfg.runs(step):
            shared(step, *STAGES[step].needs)

    slots = threading.BoundedSemaphore(max_concurrency)
    futures = [
        sweep_branch.submit(cfg, list(ls), shared.manifests, dispatch, slots) for ls in layer_sets
    ]
    rows = [f.result() for f in futures]
    winner = pick_winner(rows)

    out = cfg.work_dir / "sweep"
    chart = comparison_chart(rows, out / "comparison.png")
    (out / "comparison.json").write_text(json.dumps({"winner": winner, "rows": rows}, indent=2))
    table = [
        {
            "layers": ",".join(map(str, r["layers"])),
            "tau": r["tau"],
            "per_position_acceptance": ", ".join(
                f"{a:.3f}" for a in r["per_position_acceptance"] or []
            ),
            "train_loss": r["train_loss"],
            "wall_s": r["stage_wall_s"],
            "slot_wait_s": r["slot_wait_s"],
            "winner": "yes" if r is winner else "",
        }
        for r in rows
    ]
    create_table_artifact(
        table=table,
        key=artifact_key(cfg.name, "sweep", "table"),
        description=f"layer sweep: winner {winner['layers']}",
    )
    md = (
        f"# layer sweep {cfg.name}\n\nWinner: **{winner['layers']}** (τ = {winner['tau']}, "
        f"train loss = {winner['train_loss']}), draft `{winner['draft']}`\n\n"
        + (png_markdown(chart, "layer sweep") if chart else "")
    )
    create_markdown_artifact(
        markdown=md,
        key=artifact_key(cfg.name, "sweep", "winner"),
        description="layer sweep winner and chart",
    )
    get_run_logger().info("layer sweep %s: winner %s", cfg.name, winner["layers"])
    return {"winner": winner, "rows": rows}
