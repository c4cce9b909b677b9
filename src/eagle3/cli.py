"""`eagle3` command line. One sub-command per stage of the stage declaration (eagle3.stage_graph,
resolved by eagle3.stages), and `stream` for its streaming step; a stage's flags are generated from
its config class, so every flag is a field, `--help` shows the field's
description and default, and validation errors name the field.

    eagle3 prepare --target T --data D --out DIR [--max-seq-len N] [--limit N]
    eagle3 capture --target T --data PREPARED --out DIR [--aux-layer-ids 2,4,5] [--backend vllm|hf]
    eagle3 fetch-target smollm2-135m-instruct --out DIR   # a known target as a plain HF dir
    eagle3 run --config configs/demo.yaml          # the whole pipeline
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3.config import (
    RENAMED_CONFIG_KEYS,
    ConfigError,
    deep_merge,
    format_validation_error,
    load_pipeline_config,
    load_yaml,
)
from eagle3.config.fields import MOVED_NOTE
from eagle3.console import configure_output
from eagle3.diagnose import describe_failure
from eagle3.pipeline import run_pipeline_from_file, summarize_run
from eagle3.plan import PlanConfig, format_plan, run_plan
from eagle3.stages import (
    STAGES,
    STREAM_HELP,
    STREAM_STEP,
    build_stage_config,
    config_class,
    jsonable,
    run_stage_function,
    stage_names,
)

PLAN_HELP = (
    "estimate disk, capture time and training GPU-hours of a pipeline config on a hardware "
    "profile, and which capture mode (offline or streaming) fits the disk"
)


ESTIMATE_HELP = (
    "offline τ of a trained draft on captured held-out prompts: replays greedy drafting rounds as "
    "vLLM runs them (no engine needed; picks checkpoints)"
)


def _unwrap_optional(tp: Any) -> Any:
    """`X | None` -> X, and `Annotated[X, ...]` (eagle3.config.Count, Number) -> X."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            tp = args[0]
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _add_field_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    prefix: str = "",
    positional: tuple[str, ...] = (),
) -> None:
    """A flag per field of `model`; a nested model's fields become `--group-field` flags, listed
    under the group's name in `--help`."""
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        if name in positional:
            parser.add_argument(
                name,
                metavar=name.upper(),
                nargs="?",
                default=argparse.SUPPRESS,
                help=field.description or "",
            )
            continue
        tp = _unwrap_optional(field.annotation)
        dest = f"{prefix}{name}"
        flag = "--" + dest.replace("_", "-").replace(".", "-")
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            group = parser.add_argument_group(dest, (tp.__doc__ or "").strip().split("\n\n")[0])
            _add_field_flags(group, tp, prefix=f"{dest}.")
            continue
        default = None if field.default_factory or field.is_required() else field.default
        desc = field.description or ""
        help_text = f"{desc} (default: {default})" if default is not None else desc
        if field.is_required():
            help_text = f"{desc} (required)" if desc else "(required)"
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            kwargs["choices"] = list(typing.get_args(tp))
        elif origin is list:
            kwargs["metavar"] = "A,B,..."
        elif tp in (int, float):
            kwargs["type"] = tp
            kwargs["metavar"] = "N" if tp is int else "X"
        elif tp is Path:
            kwargs["metavar"] = (field.json_schema_extra or {}).get("metavar", "DIR")
        else:
            kwargs["metavar"] = "VALUE"
        parser.add_argument(flag, **kwargs)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return out


RENAMED_NOTE = "same meaning and values"


class _RenamedFlag(argparse.Action):
    """A flag whose field was renamed or moved into a group: refused with the new name
    (eagle3.config.RENAMED_CONFIG_KEYS, a config class's MOVED_KEYS)."""

    def __init__(self, *args: Any, new: str, note: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.new, self.note = new, note

    def __call__(self, parser, namespace, values, option_string=None):  # argparse's signature
        parser.error(f"{option_string} was renamed to {self.new}: use {self.new} ({self.note})")


def _flag(key: str) -> str:
    """`optimizer.lr` -> `--optimizer-lr`."""
    return "--" + key.replace("_", "-").replace(".", "-")


def _add_renamed_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], prefix: str = ""
) -> None:
    """Hidden flags for the fields of `model` (and of its groups) that were renamed
    (RENAMED_CONFIG_KEYS) or moved into a group (a model's MOVED_KEYS: `--lr` ->
    `--optimizer-lr`): each is refused with its new name."""
    fields = model.model_fields
    groups = {
        name: tp
        for name, field in fields.items()
        if isinstance(tp := _unwrap_optional(field.annotation), type) and issubclass(tp, BaseModel)
    }
    renamed = {
        old: (new, RENAMED_NOTE)
        for old, new in RENAMED_CONFIG_KEYS.items()
        if new in fields and old not in fields
    }
    moved = {  # (`--loss-decay` was loss_decay and is loss.decay: the same flag)
        old: (new, RENAMED_NOTE if model.MOVED_NOTE == MOVED_NOTE else model.MOVED_NOTE)
        for old, new in getattr(model, "MOVED_KEYS", {}).items()
        if (old not in fields or old in groups) and _flag(old) != _flag(new)
    }
    for old, (new, note) in {**renamed, **moved}.items():
        parser.add_argument(
            _flag(prefix + old),
            nargs="?",
            help=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            action=functools.partial(_RenamedFlag, new=_flag(prefix + new), note=note),
        )
    for name, group in groups.items():
        _add_renamed_flags(parser, group, prefix=f"{prefix}{name}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="Train EAGLE-3 draft models for your own target LLM."
    )
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on failure, print the traceback too (default: only the diagnosis)",
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        default=False,
        help="on failure, print the traceback too (default: only the diagnosis)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage, spec in STAGES.items():
        p = sub.add_parser(stage, help=spec.help, description=spec.help, parents=[verbose])
        p.add_argument(
            "--config",
            metavar="FILE",
            help="YAML with this stage's fields, or a pipeline config (its resolved `"
            + stage
            + "` section); flags override it",
        )
        _add_field_flags(p, config_class(spec), positional=spec.positional)
        _add_renamed_flags(p, config_class(spec))
    plan = sub.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP, parents=[verbose])
    _add_field_flags(plan, PlanConfig)
    from eagle3.train.estimate import (
        EstimateConfig,  # torch: `import eagle3.cli` stays light (tests, tasks)
    )

    estimate = sub.add_parser(
        "estimate", help=ESTIMATE_HELP, description=ESTIMATE_HELP, parents=[verbose]
    )
    _add_field_flags(estimate, EstimateConfig)
    stream = sub.add_parser(STREAM_STEP, parents=[verbose], help=STREAM_HELP)
    stream.add_argument(
        "--config", metavar="FILE", required=True, help="pipeline YAML with a `stream:` section"
    )
    run = sub.add_parser(
        "run",
        parents=[verbose],
        help="run the whole pipeline (Prefect flow on the embedded local API)",
    )
    run.add_argument("--config", metavar="FILE", required=True, help="pipeline YAML (see configs/)")
    run.add_argument(
        "--no-prefect", action="store_true", help="run the stages in-process without Prefect"
    )
    return parser


def stage_config_from_args(stage: str, args: argparse.Namespace):
    values: dict[str, Any] = {}
    source = "command line"
    if getattr(args, "config", None):
        raw = load_yaml(args.config)
        source = f"{args.config} + command line"
        kind = STAGES[stage].kind
        if (kind == "source" and raw.get("fetch_target") and "target" in raw) or (
            kind != "source"
            and "target" in raw
            and ("data" in raw or "synthesize" in raw)
            and (any(k in raw for k in stage_names("pipeline")) or "work_dir" in raw)
        ):  # a pipeline config: the stage's config in it (its section resolved, a stream variant)
            values = (
                load_pipeline_config(args.config).stage_config(stage).model_dump(exclude={"stage"})
            )
        else:
            values = raw
    flat = {k: v for k, v in vars(args).items() if k not in ("command", "config", "verbose")}

    values = deep_merge(values, _nest(flat))
    return build_stage_config(stage, values, source=source)


def build_tool_config(cls: type[BaseModel], args: argparse.Namespace) -> Any:
    """The config of a command that is not a pipeline stage (plan, estimate): flags only."""
    try:
        return cls.model_validate(
            _nest({k: v for k, v in vars(args).items() if k not in ("command", "verbose")})
        )
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "command line")) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    configure_output(verbose=getattr(args, "verbose", False))  # before vLLM or Prefect is imported
    try:
        if args.command == "run":
            result = run_pipeline_from_file(args.config, use_prefect=not args.no_prefect)
            print(summarize_run(args.config, result))
            return 0
        elif args.command == STREAM_STEP:
            from eagle3.stream import run_stream  # torch, the capture and training sides

            result = run_stream(load_pipeline_config(args.config))
        elif args.command == "plan":
            cfg = build_tool_config(PlanConfig, args)
            result = run_plan(cfg)
            if cfg.format == "table":
                print(format_plan(result))
                return 0
        elif args.command == "estimate":
            from eagle3.train.estimate import EstimateConfig, estimate_acceptance  # torch

            result = estimate_acceptance(build_tool_config(EstimateConfig, args))
        else:
            cfg = stage_config_from_args(args.command, args)
            result = run_stage_function(args.command, cfg)
    except Exception as e:  # a diagnosis; bugs keep their traceback
        message = describe_failure(e)
        if message is None:
            raise
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"eagle3 {args.command}: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(jsonable(result), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
