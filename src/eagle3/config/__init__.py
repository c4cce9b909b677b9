"""One validated config object per stage, nested in a PipelineConfig.

Every CLI flag of `eagle3 <stage>` is a field of that stage's config (the CLI is generated from
these classes, see cli.py), and every field's description is its `--help` text. Unknown keys are
errors that name the key. A stage's input/output paths (`target`, `data`, `out`, ...) are optional
in the model so that a PipelineConfig can fill them from its top-level `target`/`data`/`work_dir`; a
stage run on its own checks them with `require(...)`, which names the missing flag.

One module per concern; `from eagle3.config import X` reaches every public name:

    fields         the field types (Count, Number, ...) and the base of a section's groups
    base           StageConfig, the fields several stages share (written once), errors, YAML
    data           synthesize, mix, regenerate, prepare
    capture        capture, and the aux layer ids (AuxLayerIds: default and rules)
    train_options  train's groups, one per component of the trainer (loader, draft, loss, ...)
    train          vocab, train (its inputs and run length; the rest in its groups), refine
    evaluate       export, evaluate, and k (DEFAULT_NUM_SPECULATIVE_TOKENS)
    stream         streaming mode: the spool's settings and its two sides
    pipeline       PipelineConfig: the sections, the paths filled in from the stage declaration
                   (eagle3.stage_graph), fetch-target, load_pipeline_config

A key of an earlier flat layout is an error naming its group (eagle3.config.fields.MovedKeys).
"""

from eagle3.config.base import (
    RENAMED_CONFIG_KEYS,
    TEMPLATE_KWARGS_HELP,
    TRUST_REMOTE_CODE_HELP,
    ChatTemplateKwargs,
    ConfigError,
    StageConfig,
    TemplateKwargs,
    TrustRemoteCode,
    deep_merge,
    format_validation_error,
    load_yaml,
    parse_template_kwargs,
)
from eagle3.config.capture import AuxLayerIdList, AuxLayerIds, CaptureConfig, LayerId, StorageDtype
from eagle3.config.data import (
    DEFAULT_SYNTH_DOMAINS,
    MixConfig,
    MixSource,
    PrepareConfig,
    RegenerateConfig,
    SynthDomain,
    SynthesizeConfig,
    parse_domains,
    parse_mix_sources,
)
from eagle3.config.evaluate import (
    COMPARE_METHODS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    EvaluateConfig,
    ExportConfig,
)
from eagle3.config.fields import ComputeDtype, Count, LossWeighting, Number
from eagle3.config.pipeline import (
    PIPELINE_WIDE,
    FetchTargetConfig,
    PipelineConfig,
    load_pipeline_config,
)
from eagle3.config.stream import (
    SpoolSettings,
    StreamCaptureConfig,
    StreamConfig,
    StreamTrainConfig,
)
from eagle3.config.train import (
    RefineConfig,
    RefineOptimizerOptions,
    RefineScheduleOptions,
    TrainConfig,
    VocabConfig,
)

__all__ = [
    "COMPARE_METHODS",
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "DEFAULT_SYNTH_DOMAINS",
    "PIPELINE_WIDE",
    "RENAMED_CONFIG_KEYS",
    "TEMPLATE_KWARGS_HELP",
    "TRUST_REMOTE_CODE_HELP",
    "AuxLayerIdList",
    "AuxLayerIds",
    "CaptureConfig",
    "ChatTemplateKwargs",
    "ComputeDtype",
    "ConfigError",
    "Count",
    "EvaluateConfig",
    "ExportConfig",
    "FetchTargetConfig",
    "LayerId",
    "LossWeighting",
    "MixConfig",
    "MixSource",
    "Number",
    "PipelineConfig",
    "PrepareConfig",
    "RefineConfig",
    "RefineOptimizerOptions",
    "RefineScheduleOptions",
    "RegenerateConfig",
    "SpoolSettings",
    "StageConfig",
    "StorageDtype",
    "StreamCaptureConfig",
    "StreamConfig",
    "StreamTrainConfig",
    "SynthDomain",
    "SynthesizeConfig",
    "TemplateKwargs",
    "TrainConfig",
    "TrustRemoteCode",
    "VocabConfig",
    "deep_merge",
    "format_validation_error",
    "load_pipeline_config",
    "load_yaml",
    "parse_domains",
    "parse_mix_sources",
    "parse_template_kwargs",
]
