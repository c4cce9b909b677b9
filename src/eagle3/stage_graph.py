"""The pipeline's stages, each declared once: its config class, its library function, the outputs it
reads and the output it writes, and how it runs.

Everything that lists or wires stages reads this table:
  - `PipelineConfig.resolved()` (eagle3.config): every stage's output directory
    (<work_dir>/<writes>) and every input field (`reads`: another stage's output; when that stage
    does not run, what it would have read, `passes_on`), the settings it takes from another section
    (`settings`); `stream_stages()`: the streaming variants the same way;
  - the pre-flight (eagle3.preflight): every stage `eagle3 run` runs, its inputs from outside
    the pipeline (`external_inputs`: the cache key fingerprints the same fields) and the outputs
    it reads;
  - the registry (eagle3.stages): the config classes and functions by name, `needs` (the stages
    whose outputs a stage reads: the upstream of its cache key), the order of `eagle3 run` and the
    streaming step, the CLI's sub-commands (eagle3.cli);
  - the in-process pipeline (eagle3.pipeline) and the Prefect layer: one task per stage, a GPU
    stage flow and deployments per `gpu` stage (prefect.yaml; tests/test_prefect_units.py keeps them
    equal), the sweep's shared and per-branch stages (flows/sweep.py).

It names classes and functions by string and imports nothing of eagle3, so that eagle3.config (at
the bottom of the library's layers) can read it; eagle3.stages resolves the names.

A new stage: its config class in eagle3.config (and a PipelineConfig section named like it when
`eagle3 run` runs it), its `run_<stage>(cfg)` function in its module, and one `Stage(...)` row here,
placed where it runs in the pipeline (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle3.code_version import code_version

#: PipelineConfig fields that fill the field of that name in every section that has one: inputs
#: from outside the pipeline (paths), and settings
PIPELINE_INPUTS = ("target",)
PIPELINE_SETTINGS = ("chat_template_kwargs",)

#: "pipeline": a PipelineConfig section that `eagle3 run` runs; "stream": a variant of a pipeline
#: stage for streaming mode (PipelineConfig.stream_stages builds its config); "source": brings a
#: pipeline input into place (fetch-target)
StageKind = Literal["pipeline", "stream", "source"]

#: the module the bare config class names are in
CONFIG_MODULE = "eagle3.config"
#: streaming mode's step in `eagle3 run` (eagle3.stream.run_stream, `eagle3 stream`): the stream
#: variants at once through the spool, in place of the stages they stand for
STREAM_STEP = "stream"
STREAM_HELP = (
    "streaming mode: stream-capture and stream-train at once in this process (bounded disk; "
    "prepare and vocab must have run)"
)


@dataclass(frozen=True)
class Stage:
    name: str  # the CLI sub-command, the Prefect task name, the PipelineConfig section
    config: str  # its config class: one of eagle3.config, or "module:Class" (every field a flag)
    function: str  # "module:function", imported on first call (`eagle3 --help` stays fast)
    help: str  # the CLI help line
    kind: StageKind = "pipeline"
    writes: str | None = None  # its output directory's name under the work dir
    #: input field -> whose output it is: "stage", "stage/file in its output", "@pipeline field"
    reads: Mapping[str, str] = field(default_factory=dict)
    #: input field -> "@pipeline field" it also takes, from outside the pipeline's own outputs
    #: (mix: the pipeline's `data` is its first source, beside synthesize's prompts)
    inputs: Mapping[str, str] = field(default_factory=dict)
    #: field -> "section.field" (dotted further into groups): a setting taken from another section
    settings: Mapping[str, str] = field(default_factory=dict)
    passes_on: str | None = None  # when it does not run, a reader of its output gets this field
    #: inputs keyed by their file's content, not by their stage's manifest (not in `needs`)
    content_keyed: tuple[str, ...] = ()
    variant_of: str | None = None  # a stream variant: the pipeline stage it stands for
    subprocess: bool = False  # under Prefect, runs in a fresh process (an engine, GPU state)
    gpu: bool = False  # has a GPU stage flow and deployments of its own (eagle3-<name>)
    #: whether `eagle3 run` runs it: a PipelineConfig value ("section.field", dotted further) that
    #: is true when it runs (PipelineConfig.runs); None: always
    enabled: str | None = None
    positional: tuple[str, ...] = ()  # config fields the CLI takes as positional arguments

    @property
    def config_ref(self) -> tuple[str, str]:
        """(module, class name) of its config class."""
        module, _, name = self.config.rpartition(":")
        return (module or CONFIG_MODULE, name)

    @property
    def needs(self) -> tuple[str, ...]:
        """The stages whose outputs it reads, in pipeline order: the upstream of its cache key.
        A read of a stage that passes its input on (`passes_on`) needs that input's stage too."""
        return upstream_of(self.name)

    def code_version(self, root: Path | None = None) -> str:
        """What its outputs depend on besides config and inputs: the sources of every eagle3 module
        its function and its config class can run, and the versions of the packages they import
        (eagle3.code_version). `root`: another copy of the package's directory."""
        return code_version((self.function.split(":")[0], self.config_ref[0]), root)


def _source_stage(source: str) -> str | None:
    """The stage a `reads` value names ("stage/file" -> stage; "@field" -> None)."""
    return None if source.startswith("@") else source.split("/")[0]


#: in pipeline order
STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "synthesize",
            "SynthesizeConfig",
            "eagle3.data.synthesize:run_synthesize",
            "user prompts the target writes itself, per domain (Magpie-style), filtered and "
            "deduplicated",
            writes="synthesized",
            subprocess=True,
            enabled="synthesize.enabled",
        ),
        Stage(
            "mix",
            "MixConfig",
            "eagle3.data.mix:run_mix",
            "several chat/prompt sources -> one file, each source's share set by its weight",
            writes="mixed",
            # with `data` and mix.sources (PipelineConfig.mix_sources); one source is passed on
            reads={"sources": "synthesize/prompts.jsonl"},
            inputs={"sources": "@data"},
            passes_on="sources",
            enabled="mixes",  # more than one source
        ),
        Stage(
            "regenerate",
            "RegenerateConfig",
            "eagle3.data.regenerate:run_regenerate",
            "replace dataset answers with the target's own answers (vLLM)",
            writes="regenerated",
            reads={"data": "mix/conversations.jsonl"},
            passes_on="data",
            subprocess=True,
            gpu=True,
            enabled="regenerate.enabled",
        ),
        # prepare's data is keyed by the file's content, so a regenerate rerun that writes the same
        # answers leaves prepare cached: no upstream manifest
        Stage(
            "prepare",
            "PrepareConfig",
            "eagle3.data.prepare:run_prepare",
            "chat data -> token ids + assistant-only loss masks (target's chat template)",
            writes="prepared",
            reads={"data": "regenerate/conversations.jsonl"},
            content_keyed=("data",),
        ),
        Stage(
            "capture",
            "CaptureConfig",
            "eagle3.capture:run_capture",
            "record aux + last-layer hidden states of the target (vLLM worker extension or "
            "transformers)",
            writes="captured",
            reads={"data": "prepare"},
            subprocess=True,
            gpu=True,
        ),
        Stage(
            "vocab",
            "VocabConfig",
            "eagle3.vocab:run_vocab",
            "draft vocabulary (d2t/t2d) from supervised-token frequencies",
            writes="vocab",
            reads={"data": "prepare"},
        ),
        Stage(
            "train",
            "TrainConfig",
            "eagle3.train:run_train",
            "train the EAGLE-3 draft with training-time test",
            writes="train",
            reads={"captured": "capture", "vocab": "vocab"},
            settings={"num_speculative_tokens": "evaluate.num_speculative_tokens"},
            subprocess=True,
            gpu=True,
        ),
        # refine: on-policy rounds on the trained draft; when it does not run, export reads train's
        Stage(
            "refine",
            "RefineConfig",
            "eagle3.refine:run_refine",
            "on-policy refinement of a trained draft: target rollouts of training prompts, the "
            "draft's rounds replayed on them as vLLM runs them, training at those rounds (up to "
            "each first rejected token), per-position acceptance before/after on a validation "
            "split",
            writes="refine",
            reads={
                "checkpoint": "train",
                "data": "prepare",
                "vocab": "vocab",
                "captured": "capture",
            },
            settings={
                "backend": "capture.backend",
                "device": "capture.device",
                "num_speculative_tokens": "evaluate.num_speculative_tokens",
            },
            passes_on="checkpoint",
            subprocess=True,
            gpu=True,
            enabled="refine.enabled",
        ),
        Stage(
            "export",
            "ExportConfig",
            "eagle3.export:run_export",
            "write a draft directory vLLM (or speculators) loads",
            writes="draft",
            reads={"checkpoint": "refine"},
        ),
        Stage(
            "evaluate",
            "EvaluateConfig",
            "eagle3.evaluate:run_evaluate",
            "mean acceptance length τ in real vLLM per prompt category and temperature (eagle3 "
            "draft or ngram), with the speed-up predicted per k and concurrency on a GPU machine",
            writes="evaluate",
            reads={"draft": "export", "prompts": "@eval_prompts"},
            subprocess=True,
            gpu=True,
            enabled="eval_prompts",
        ),
        # streaming mode (stream.enabled): capture's and train's variants at once through a capped
        # spool (default <work_dir>/spool, stream.spool), from their resolved sections
        Stage(
            "stream-capture",
            "StreamCaptureConfig",
            "eagle3.capture.spool:run_stream_capture",
            "streaming mode, producer: capture every epoch into a spool capped at --spool-cap-gb",
            kind="stream",
            variant_of="capture",
            writes="spool",
            settings={
                "epochs": "train.epochs",
                "val_fraction": "train.loader.val_fraction",
                "seed": "train.seed",
            },
        ),
        Stage(
            "stream-train",
            "StreamTrainConfig",
            "eagle3.train.stream:run_stream_train",
            "streaming mode, consumer: train on the spool's shards, deleting each once "
            "checkpointed",
            kind="stream",
            variant_of="train",
            reads={"captured": "stream-capture"},
        ),
        Stage(
            "fetch-target",
            "FetchTargetConfig",
            "eagle3.targets:run_fetch_target",
            "a known target model (registry: eagle3.targets) as a plain HF directory: weights, "
            "tokenizer, chat template, manifest with provenance; offline once cached",
            kind="source",
            positional=("name",),
        ),
    )
}


def stage_names(kind: StageKind) -> tuple[str, ...]:
    return tuple(n for n, s in STAGES.items() if s.kind == kind)


def upstream_of(name: str) -> tuple[str, ...]:
    """The stages whose outputs `name` reads (Stage.needs), in table order."""
    found: set[str] = set()
    stage = STAGES[name]
    todo = [src for f, src in stage.reads.items() if f not in stage.content_keyed]
    while todo:
        upstream = _source_stage(todo.pop())
        if upstream is None or upstream in found or upstream not in STAGES:
            continue
        found.add(upstream)
        passed = STAGES[upstream].passes_on
        if passed and passed in STAGES[upstream].reads:
            todo.append(STAGES[upstream].reads[passed])
    return tuple(n for n in STAGES if n in found)


def downstream_of(name: str) -> tuple[str, ...]:
    """`name` and the pipeline stages that read its output, directly or further on."""
    found = {name}
    for n in stage_names("pipeline"):
        if found & set(upstream_of(n)):
            found.add(n)
    return tuple(n for n in stage_names("pipeline") if n in found)


def streamed() -> tuple[str, ...]:
    """The pipeline stages streaming mode replaces by their stream variants."""
    return tuple(s.variant_of for s in STAGES.values() if s.variant_of)


def pipeline_order(streaming: bool = False) -> tuple[str, ...]:
    """The steps of `eagle3 run` in order; with streaming, the stream step in place of the stages it
    replaces, right after the last stage whose output they read."""
    names = list(stage_names("pipeline"))
    if not streaming:
        return tuple(names)
    replaced = streamed()
    inputs = {n for r in replaced for n in upstream_of(r)} - set(replaced)
    at = max(names.index(n) for n in inputs) + 1
    names.insert(at, STREAM_STEP)
    return tuple(n for n in names if n not in replaced)


def external_inputs() -> dict[str, str]:
    """Input field -> the PipelineConfig field it may hold: the fields stages read from outside the
    pipeline's own outputs (the cache key fingerprints their content; the pre-flight checks they
    exist). They are the pipeline-wide inputs, the `inputs`, the reads of "@field", and the reads of
    a stage that passes such an input on when it does not run (`passes_on`), in table order."""
    found = {f: f for f in PIPELINE_INPUTS}
    for stage in STAGES.values():
        for name in (*stage.inputs, *stage.reads):
            origin = pipeline_origin(stage.name, name)
            if origin is not None:
                found.setdefault(name, origin)
    return found


def pipeline_origin(stage: str, name: str) -> str | None:
    """The PipelineConfig field `stage`'s input `name` may hold (None: only stages' outputs)."""
    s = STAGES[stage]
    source = s.inputs.get(name) or s.reads.get(name)
    if source is None:
        return None
    if source.startswith("@"):
        return source[1:]
    upstream = STAGES.get(source.split("/")[0])
    if upstream is None or upstream.passes_on is None:
        return None
    return pipeline_origin(upstream.name, upstream.passes_on)
