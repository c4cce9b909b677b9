"""The configs of the draft handed to vLLM: export (eagle3.export) and evaluate
(eagle3.evaluate), with k, the draft tokens per step, set once."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from eagle3.config.base import (
    ChatTemplateKwargs,
    StageConfig,
    Temperatures,
    TensorParallelSize,
    TrustRemoteCode,
    parse_comma_list,
)
from eagle3.config.fields import ComputeDtype, Count, Number

#: k, the draft tokens per speculative step, where nothing sets it. In a pipeline it is set once, as
#: evaluate.num_speculative_tokens; train (best-checkpoint selection) and estimate read that value
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


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
    temperatures: Temperatures | None = Field(
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
    tensor_parallel_size: TensorParallelSize = 1
    speedup_hardware: str = Field(
        "h200",
        description="Hardware profile the predicted speed-up per k and concurrency is for "
        "(eagle3.hardware.HARDWARE: h200, h100, b300, rtx-pro-6000, ...; `eagle3 plan --hardware` "
        "predicts for the others from these results)",
    )
    routing: str | None = Field(
        None,
        description="The target's measured routing for the predicted speed-up (capture's "
        "routing.json or its dir; default: the one beside the capture the draft was trained on, "
        "else the uniform-routing bound, which the output says)",
    )
    seed: Count = Field(0, description="Engine seed")
    split: str = Field(
        "train", description="Split to read when --prompts is a DatasetDict directory"
    )
    trust_remote_code: TrustRemoteCode = False
    chat_template_kwargs: ChatTemplateKwargs = None
    allow_chat_template_mismatch: bool = Field(
        False,
        description="Evaluate with other chat_template_kwargs than the draft was trained with "
        "(e.g. thinking off for a draft trained thinking on): results.json labels the run "
        "instead of refusing it",
    )

    @field_validator("compare", mode="before")
    @classmethod
    def _parse_compare(cls, v: Any) -> Any:
        return parse_comma_list(v, str, "compare", ",".join(COMPARE_METHODS))

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
