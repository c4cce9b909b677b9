"""The data stages' configs (eagle3.data): synthesize, mix, regenerate and prepare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.config.base import (
    ChatTemplateKwargs,
    HfDevice,
    StageConfig,
    TemplateKwargs,
    TensorParallelSize,
    TrustRemoteCode,
    skipped_fraction_field,
)
from eagle3.config.fields import ComputeDtype, Count, Number


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
    max_skipped_fraction: Number = skipped_fraction_field(
        "the input rows is skipped (bad JSON, missing fields, nothing to supervise, ...)"
    )
    trust_remote_code: TrustRemoteCode = False
    chat_template_kwargs: ChatTemplateKwargs = None
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
    max_skipped_fraction: Number = skipped_fraction_field(
        "the input rows cannot be read (bad JSON, missing fields, ...), before anything is "
        "generated"
    )
    tensor_parallel_size: TensorParallelSize = 1
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
    device: HfDevice = "auto"
    dtype: ComputeDtype = Field(
        "auto",
        description="Target compute dtype in vLLM; auto = float32 on CPUs without native bf16 "
        "(AVX2: ~5x faster than bf16), bfloat16 elsewhere",
    )
    trust_remote_code: TrustRemoteCode = False
    chat_template_kwargs: ChatTemplateKwargs = None
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
    trust_remote_code: TrustRemoteCode = False
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
    tensor_parallel_size: TensorParallelSize = 1
    seed: Count = Field(0, description="Seed of sampling, seed-phrase choice and MinHash")
    backend: Literal["vllm", "hf"] = Field(
        "vllm",
        description="vllm: offline vLLM engine; hf: transformers generate (hosts without vLLM)",
    )
    device: HfDevice = "auto"
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
    max_skipped_fraction: Number = skipped_fraction_field(
        "a source's rows cannot be read (bad JSON, missing fields, ...)"
    )
    data_weight: Number = Field(
        1.0, gt=0, description="Pipeline only: weight of the pipeline's `data`"
    )
    synthesize_weight: Number = Field(
        1.0, gt=0, description="Pipeline only: weight of synthesize's prompts"
    )

    _parse_sources = field_validator("sources", mode="before")(lambda cls, v: parse_mix_sources(v))
