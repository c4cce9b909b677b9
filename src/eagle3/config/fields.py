"""The field types every config section is written with, and the base of a section's groups.

Every module of eagle3.config (the stage configs, train's groups in eagle3.config.train_options)
builds on this one, which imports nothing of eagle3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


def refuse_bool(value: Any) -> Any:
    """A number field given `true`/`false` (YAML `limit: true` would read as 1): refused, not
    converted."""
    if isinstance(value, bool):
        raise ValueError(
            f"{str(value).lower()} is a boolean, but a number is expected here; write "
            "the number (e.g. 100), or leave the key out for its default"
        )
    return value


#: an integer field (a count, a size, a seed): whole numbers from YAML, JSON or the CLI; booleans
#: refused
Count = Annotated[int, BeforeValidator(refuse_bool)]
#: a real-valued field (a weight, a fraction, a rate): numbers; booleans refused
Number = Annotated[float, BeforeValidator(refuse_bool)]
#: the dtype a stage runs the target in (vLLM's or transformers'); auto = float32 on CPUs without
#: native bf16, bfloat16 elsewhere
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]
#: how the TTT loss weighs the rows of step j (LossOptions.loss_weighting, eagle3.train.step)
LossWeighting = Literal["uniform", "accept_until_fail"]
#: the lr's decay after warmup (ScheduleOptions.decay, eagle3.train.loop.lr_lambda)
Decay = Literal["cosine", "linear", "constant"]

#: the error type of a key that moved into a group (format_validation_error reads its context)
MOVED_KEYS_ERROR = "moved_keys"


#: what a moved key's error says after the keys (refuse_moved_keys' default `note`)
MOVED_NOTE = "same meaning and values: write each key under its group"


class MovedKeys:
    """A section whose keys of earlier versions moved: MOVED_KEYS (old key -> its place now,
    dotted relative to the section) are refused with their new place (refuse_moved_keys), and
    the CLI refuses their old flags the same way (eagle3.cli)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {}
    MOVED_NOTE: ClassVar[str] = MOVED_NOTE

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        return refuse_moved_keys(data, cls.MOVED_KEYS, cls.model_fields, cls.MOVED_NOTE)


class OptionGroup(MovedKeys, BaseModel):
    """One group of a stage's settings (`train.optimizer`, `train.data`, ...): a nested section of
    the YAML and `--group-field` flags on the command line."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def refuse_moved_keys(
    data: Any, moved: Mapping[str, str], fields: Mapping[str, Any], note: str = MOVED_NOTE
) -> Any:
    """A section's `mode="before"` check: when `data` (the section's mapping) holds a key of
    `moved` (old key -> its place now, dotted relative to the section: `optimizer.lr`) that is
    no longer a field there, or names a group with a plain value (`schedule: cosine` where
    `schedule` is now a group), one error lists every such key with its new place, so the
    YAML is fixed at once; `note` ends the message. Other data passes through."""
    if not isinstance(data, Mapping):
        return data
    found = []
    for old, new in moved.items():
        if old not in data:
            continue
        is_group_now = old in fields and not isinstance(data[old], Mapping | BaseModel)
        if old not in fields or (is_group_now and new.startswith(old + ".")):
            found.append((old, new))
    if found:
        raise PydanticCustomError(
            MOVED_KEYS_ERROR,
            "{listing}",
            {
                "moved": found,
                "note": note,
                "listing": "; ".join(f"{old} moved to {new}" for old, new in found) + f" ({note})",
            },
        )
    return data
