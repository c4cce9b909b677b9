"""The stage registry: the stage declaration (eagle3.stage_graph, every stage once) with its names
resolved to the library's config classes and functions.

The CLI (one sub-command per stage, flags from the config class), the in-process pipeline
(eagle3.pipeline) and the Prefect layer run stages through this module; the declaration itself, and
the order and wiring derived from it, are in eagle3.stage_graph.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3.config import ConfigError, StageConfig, format_validation_error
from eagle3.stage_graph import (
    STAGES,
    STREAM_HELP,
    STREAM_STEP,
    Stage,
    StageKind,
    downstream_of,
    external_inputs,
    pipeline_order,
    stage_names,
    streamed,
    upstream_of,
)

__all__ = [
    "STAGES",
    "STREAM_HELP",
    "STREAM_STEP",
    "Stage",
    "StageKind",
    "build_stage_config",
    "config_class",
    "downstream_of",
    "external_inputs",
    "get_stage",
    "jsonable",
    "pipeline_order",
    "run_stage_function",
    "stage_function",
    "stage_names",
    "streamed",
    "upstream_of",
]


def get_stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise ConfigError(
            f"stage {name!r} is not a stage: use one of {', '.join(STAGES)}"
        ) from None


def config_class(stage: str | Stage) -> type[StageConfig]:
    """The config class a stage declares (imported now)."""
    module, name = (stage if isinstance(stage, Stage) else get_stage(stage)).config_ref
    return getattr(importlib.import_module(module), name)


def stage_function(stage: str) -> Callable[[Any], Any]:
    """The library function a stage declares (imported now)."""
    module, func = get_stage(stage).function.split(":")
    return getattr(importlib.import_module(module), func)


def build_stage_config(
    stage: str, values: dict[str, Any], source: str = "arguments"
) -> StageConfig:
    """Validate `values` as `stage`'s config; a ConfigError names the source, the field and the
    value."""
    try:
        return config_class(stage).model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def run_stage_function(stage: str, cfg: StageConfig) -> Any:
    """Run `stage`'s library function on `cfg` in this process."""
    return stage_function(stage)(cfg)


def jsonable(obj: Any) -> Any:
    """A stage result as plain JSON data: dataclasses and records (pydantic models) -> dicts,
    tuples -> lists, paths -> strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, BaseModel):
        return jsonable(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
