"""The stage registry: every stage once, with its config class, its library function and how it
runs.

Everything that lists stages reads this table: the CLI (one sub-command per stage, flags from the
config class), the in-process pipeline (eagle3.pipeline: order and which stages a config enables),
the Prefect tasks and flows (one task per stage; a subprocess or a GPU deployment where marked) and
the deployments (prefect.yaml has one GPU stage flow per `gpu` stage; tests/test_prefect_units.py
keeps them equal).

A stage's code version (its cache key's) is not listed here: Stage.code_version reads it from the
imports of its function's module (eagle3.code_version).

A new stage: its config class in eagle3.config (and a PipelineConfig section + paths in `resolved()`
when `eagle3 run` runs it), its `run_<stage>(cfg)` function in its module, and one `Stage(...)` row
here, placed where it runs in the pipeline (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from eagle3.code_version import code_version
from eagle3.config import (
    CaptureConfig,
    ConfigError,
    EvaluateConfig,
    ExportConfig,
    FetchTargetConfig,
    MixConfig,
    PipelineConfig,
    PrepareConfig,
    RefineConfig,
    RegenerateConfig,
    StageConfig,
    StreamCaptureConfig,
    StreamTrainConfig,
    SynthesizeConfig,
    TrainConfig,
    VocabConfig,
    format_validation_error,
)

#: "pipeline": a PipelineConfig section that `eagle3 run` runs; "stream": a side of streaming mode
#: (both derived by PipelineConfig.stream_stages); "source": brings a pipeline input into place
#: (fetch-target)
StageKind = Literal["pipeline", "stream", "source"]


def _always(cfg: PipelineConfig) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    name: str  # the CLI sub-command, the Prefect task name, the PipelineConfig section
    config: type[StageConfig]  # its one validated config (every field a CLI flag)
    function: str  # "module:function", imported on first call (`eagle3 --help` stays fast)
    help: str  # the CLI help line
    kind: StageKind = "pipeline"
    needs: tuple[str, ...] = ()  # stages whose outputs it reads: upstream of its Prefect cache key
    subprocess: bool = (
        False  # under Prefect, runs in a fresh process (an engine of the target, GPU state)
    )
    gpu: bool = (
        False  # has a GPU stage flow and deployments of its own (eagle3-<name>, prefect.yaml)
    )
    enabled: Callable[[PipelineConfig], bool] = (
        _always  # whether `eagle3 run` runs it for this config
    )
    positional: tuple[str, ...] = ()  # config fields the CLI takes as positional arguments

    def resolve(self) -> Callable[[Any], Any]:
        """The library function (imported now)."""
        module, func = self.function.split(":")
        return getattr(importlib.import_module(module), func)

    def code_version(self, root: Path | None = None) -> str:
        """What its outputs depend on besides config and inputs: the sources of every eagle3 module
        its function and its config class can run, and the versions of the packages they import
        (eagle3.code_version). `root`: another copy of the package's directory."""
        return code_version((self.function.split(":")[0], self.config.__module__), root)

    def run(self, cfg: StageConfig) -> Any:
        """Run the stage in this process; returns the library function's result."""
        return self.resolve()(cfg)


#: in pipeline order
STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "synthesize",
            SynthesizeConfig,
            "eagle3.data.synthesize:run_synthesize",
            "user prompts the target writes itself, per domain (Magpie-style), filtered and "
            "deduplicated",
            subprocess=True,
            enabled=lambda c: c.synthesize.enabled,
        ),
        Stage(
            "mix",
            MixConfig,
            "eagle3.data.mix:run_mix",
            "several chat/prompt sources -> one file, each source's share set by its weight",
            needs=("synthesize",),
            enabled=lambda c: len(c.mix_sources()) > 1,
        ),
        Stage(
            "regenerate",
            RegenerateConfig,
            "eagle3.data.regenerate:run_regenerate",
            "replace dataset answers with the target's own answers (vLLM)",
            needs=("mix",),
            subprocess=True,
            gpu=True,
            enabled=lambda c: c.regenerate.enabled,
        ),
        # prepare's `data` (regenerated/conversations.jsonl after regenerate) keys it by that file's
        # content, so a regenerate rerun that writes the same answers leaves prepare cached: no
        # upstream manifest
        Stage(
            "prepare",
            PrepareConfig,
            "eagle3.data.prepare:run_prepare",
            "chat data -> token ids + assistant-only loss masks (target's chat template)",
        ),
        Stage(
            "capture",
            CaptureConfig,
            "eagle3.capture:run_capture",
            "record aux + last-layer hidden states of the target (vLLM worker extension or "
            "transformers)",
            needs=("prepare",),
            subprocess=True,
            gpu=True,
        ),
        Stage(
            "vocab",
            VocabConfig,
            "eagle3.vocab:run_vocab",
            "draft vocabulary (d2t/t2d) from supervised-token frequencies",
            needs=("prepare",),
        ),
        Stage(
            "train",
            TrainConfig,
            "eagle3.train:run_train",
            "train the EAGLE-3 draft with training-time test",
            needs=("capture", "vocab"),
            subprocess=True,
            gpu=True,
        ),
        # refine: on-policy rounds on the trained draft; when it runs, export reads its output
        Stage(
            "refine",
            RefineConfig,
            "eagle3.refine:run_refine",
            "on-policy refinement of a trained draft: target rollouts of training prompts, the "
            "draft's rounds replayed on them as vLLM runs them, training at those rounds (up to "
            "each first rejected token), per-position acceptance before/after on a validation "
            "split",
            needs=("train", "prepare", "capture", "vocab"),
            subprocess=True,
            gpu=True,
            enabled=lambda c: c.refine.enabled,
        ),
        Stage(
            "export",
            ExportConfig,
            "eagle3.export:run_export",
            "write a draft directory vLLM (or speculators) loads",
            needs=("train", "refine"),
        ),
        Stage(
            "evaluate",
            EvaluateConfig,
            "eagle3.evaluate:run_evaluate",
            "mean acceptance length τ in real vLLM per prompt category and temperature (eagle3 "
            "draft or ngram), with the draft's cost and a modelled speed-up",
            needs=("export",),
            subprocess=True,
            gpu=True,
            enabled=lambda c: bool(c.eval_prompts),
        ),
        Stage(
            "stream-capture",
            StreamCaptureConfig,
            "eagle3.capture.spool:run_stream_capture",
            "streaming mode, producer: capture every epoch into a spool capped at --spool-cap-gb",
            kind="stream",
        ),
        Stage(
            "stream-train",
            StreamTrainConfig,
            "eagle3.train.stream:run_stream_train",
            "streaming mode, consumer: train on the spool's shards, deleting each once "
            "checkpointed",
            kind="stream",
        ),
        Stage(
            "fetch-target",
            FetchTargetConfig,
            "eagle3.targets:run_fetch_target",
            "a known target model (registry: eagle3.targets) as a plain HF directory: weights, "
            "tokenizer, chat template, manifest with provenance; offline once cached",
            kind="source",
            positional=("name",),
        ),
    )
}

#: streaming mode's step (eagle3.stream.run_stream on the PipelineConfig): capture and train at once
#: through the spool, after vocab; it stands for the stages marked streamed below in the streaming
#: order
STREAM_STEP = "stream"
STREAMED = ("capture", "train")


def stage_names(kind: StageKind) -> tuple[str, ...]:
    return tuple(n for n, s in STAGES.items() if s.kind == kind)


def pipeline_order(streaming: bool = False) -> tuple[str, ...]:
    """The steps of `eagle3 run` in order; with streaming, vocab first and then capture + train at
    once."""
    names = [n for n in stage_names("pipeline") if not (streaming and n in STREAMED)]
    if streaming:
        names.insert(names.index("vocab") + 1, STREAM_STEP)
    return tuple(names)


def get_stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise ConfigError(
            f"stage {name!r} is not a stage: use one of {', '.join(STAGES)}"
        ) from None


def build_stage_config(
    stage: str, values: dict[str, Any], source: str = "arguments"
) -> StageConfig:
    """Validate `values` as `stage`'s config; a ConfigError names the source, the field and the
    value."""
    try:
        return get_stage(stage).config.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def run_stage_function(stage: str, cfg: StageConfig) -> Any:
    """Run `stage`'s library function on `cfg` in this process."""
    return get_stage(stage).run(cfg)


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
