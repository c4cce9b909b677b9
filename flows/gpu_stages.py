"""The GPU-heavy stages as flows of their own, deployed on hardware-tagged work pools (prefect.yaml:
eagle3-regenerate/gpu-1x, eagle3-capture/gpu-8x, ...). The pipeline flow launches them with
`run_deployment` (tasks/dispatch.py); each runs the same cached, verified stage task a local run uses.
Parameters are the stage's own config model, so the UI shows a form for a one-off stage run too.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from tasks.dispatch import heartbeat
from tasks.stages import run_stage

from eagle3.config import CaptureConfig, EvaluateConfig, RegenerateConfig, TrainConfig

Upstream = dict[str, dict[str, Any]]


@flow(name="eagle3-regenerate", log_prints=True)
def regenerate_stage(config: RegenerateConfig, upstream: Upstream | None = None, run_name: str = "eagle3") -> dict[str, Any]:
    """Stage 1 on a GPU pool: the target answers the dataset's prompts."""
    with heartbeat(config.out):  # the parent re-dispatches a run whose heartbeat stops (tasks/dispatch.py)
        return run_stage("regenerate", config, upstream, run_name=run_name)


@flow(name="eagle3-capture", log_prints=True)
def capture_stage(config: CaptureConfig, upstream: Upstream | None = None, run_name: str = "eagle3") -> dict[str, Any]:
    """Stage 3 on a GPU pool: aux + last hidden states of the target."""
    with heartbeat(config.out):  # the parent re-dispatches a run whose heartbeat stops (tasks/dispatch.py)
        return run_stage("capture", config, upstream, run_name=run_name)


@flow(name="eagle3-train", log_prints=True)
def train_stage(config: TrainConfig, upstream: Upstream | None = None, run_name: str = "eagle3") -> dict[str, Any]:
    """Stage 5 on a GPU pool: train the draft."""
    with heartbeat(config.out):  # the parent re-dispatches a run whose heartbeat stops (tasks/dispatch.py)
        return run_stage("train", config, upstream, run_name=run_name)


@flow(name="eagle3-evaluate", log_prints=True)
def evaluate_stage(config: EvaluateConfig, upstream: Upstream | None = None, run_name: str = "eagle3") -> dict[str, Any]:
    """Stage 7 on a GPU pool: τ in real vLLM."""
    with heartbeat(config.out):  # the parent re-dispatches a run whose heartbeat stops (tasks/dispatch.py)
        return run_stage("evaluate", config, upstream, run_name=run_name)
