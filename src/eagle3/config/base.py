"""What every stage config is built from: the base class, the field types and help texts that
several stages share (each written once here), the error type, and reading a YAML file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from eagle3.config.fields import MOVED_KEYS_ERROR, MovedKeys, Number, refuse_bool
from eagle3.errors import UserError

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
    "Keyword arguments for the target's chat template, as JSON on the command line, e.g. "
    "'{\"enable_thinking\": false}' (Qwen3, GLM) or '{\"thinking\": true}' (Kimi, DeepSeek-V3.1) "
    "(or key=value pairs: enable_thinking=false); a row's own `chat_template_kwargs` (its "
    "source's) wins. Pipeline: the top-level `chat_template_kwargs` fills it"
)
TRUST_REMOTE_CODE_HELP = (
    "Run the Python code a target directory ships (a custom tokenizer such as Kimi-K2.5's "
    "tiktoken one, a custom model config); off by default: only for a target you trust. "
    "Pipeline: the top-level `trust_remote_code` turns it on for every stage"
)


def parse_comma_list(
    value: Any, item: Callable[[str], Any], field: str, example: str, kind: str = "values"
) -> Any:
    """A CLI flag's `a,b,c` -> [item(a), item(b), item(c)] (blanks dropped); a list from YAML
    passes through (a list field's before-validator)."""
    if not isinstance(value, str):
        return value
    try:
        return [item(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(
            f"{field} must be comma-separated values like {example}; got {value!r}"
        ) from None


def check_temperatures(value: list[float]) -> list[float]:
    if not value or any(t < 0 for t in value):
        raise ValueError(
            f"temperatures must name at least one temperature, none negative; got {value}"
        )
    return value


#: sampling temperatures, each a pass over the prompts (evaluate, refine's rollouts); `0.0,0.6` on
#: the CLI
Temperatures = Annotated[
    list[Number],
    BeforeValidator(lambda v: parse_comma_list(v, float, "temperatures", "0.0,0.6", "numbers")),
    AfterValidator(check_temperatures),
]

#: the fields several stages have, each with its one meaning and help text
TrustRemoteCode = Annotated[bool, Field(description=TRUST_REMOTE_CODE_HELP)]
ChatTemplateKwargs = Annotated[TemplateKwargs, Field(description=TEMPLATE_KWARGS_HELP)]
TensorParallelSize = Annotated[
    int, Field(gt=0, description="vLLM tensor parallel size"), BeforeValidator(refuse_bool)
]
HfDevice = Annotated[str, Field(description="hf backend device: auto, cpu, cuda, cuda:N")]


def skipped_fraction_field(what: str) -> Any:
    """`max_skipped_fraction` of a stage that reads chat rows: `what` names the rows it counts."""
    return Field(
        0.05,
        ge=0,
        le=1,
        description="Stop with an error naming the reasons and rows when more than this share of "
        f"{what}; 1 = never stop",
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


def format_validation_error(err: ValidationError, source: str) -> str:
    """One paragraph: `invalid config in SOURCE: field = value: what is wrong; next field ...`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == MOVED_KEYS_ERROR:  # fields.refuse_moved_keys
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


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
