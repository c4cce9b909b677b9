"""Capture's config (eagle3.capture) and the aux layer ids it records: their default and their
rules, shared by capture, train, export and the pre-flight."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from eagle3.config.base import (
    ConfigError,
    HfDevice,
    StageConfig,
    TensorParallelSize,
    TrustRemoteCode,
    parse_comma_list,
)
from eagle3.config.fields import ComputeDtype, Count, Number

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
        return parse_comma_list(value, int, "aux_layer_ids", "2,4,5", "integers")

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


#: a config field's aux layer ids: `2,4,5` on the CLI, each id once (AuxLayerIds.check_form)
AuxLayerIdList = Annotated[
    list[LayerId], BeforeValidator(AuxLayerIds.parse), AfterValidator(AuxLayerIds.check_form)
]


class CaptureConfig(StageConfig):
    target: str | None = Field(None, description="Target model dir")
    trust_remote_code: TrustRemoteCode = False
    data: str | None = Field(None, description="Prepared dataset dir (output of `eagle3 prepare`)")
    out: Path | None = Field(
        None, description="Output directory for safetensors shards + manifest.json"
    )
    aux_layer_ids: AuxLayerIdList | None = Field(
        None,
        description="Aux layer ids in vLLM EAGLE-3 semantics (id k = output of decoder layer k-1 = "
        "transformers output_hidden_states[k]); default (2, L//2, L-3). Comma-separated on the CLI",
    )
    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm: worker extension in a vLLM engine; hf: transformers forward"
    )
    tensor_parallel_size: TensorParallelSize = 1
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
    device: HfDevice = "auto"
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
    routing_sample_rows: Count = Field(
        64,
        ge=0,
        description="MoE targets: route this many prepared rows (a seeded sample) once more and "
        "record every token's experts in every MoE layer, as the target routes them; the distinct "
        "experts per window of tokens go to routing.json beside the shards (the verification-cost "
        "model reads it). 0 = off",
    )
