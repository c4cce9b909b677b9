"""Check a pipeline config before any stage starts: the mistakes that would otherwise surface
minutes later inside a GPU stage (or after it took the GPU) are found here, all at once, each naming
the field, the bad value and the fix.

    problems = check_pipeline(cfg)          # [] when the run can start
    require_pipeline(cfg)                   # raises ConfigError listing every problem

Checks, walking the stage declaration (eagle3.stage_graph) over every stage `eagle3 run` runs: the
target has a config.json; each input from outside the pipeline exists (data, mix's sources, eval
prompts: `external_inputs`, the fields the cache key fingerprints); each output a stage reads is
made by the stage it names (or passed on, or there already). Then the section rules: the aux layer
ids of capture (and of train, and of each sweep layer set) are valid for the target's layer count;
the draft family is registered; the capture fits the disk (the planner's own check,
eagle3.shards.check_capture_fits) once the prepared data says how many tokens it holds. Reads config
files only: no model, no tokenizer, no GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eagle3.artifacts import PreparedMeta
from eagle3.config import AuxLayerIds, ConfigError, PipelineConfig
from eagle3.io import read_json
from eagle3.stage_graph import PIPELINE_INPUTS, STAGES, external_inputs, stage_names


def read_num_layers(target: str | Path) -> int:
    """The target's decoder layer count from its config.json (ConfigError naming the file when
    unusable)."""
    from eagle3.model.draft import (
        text_config,  # torch: the flows import this module before any stage runs
    )

    p = Path(target) / "config.json"
    try:
        return int(text_config(read_json(p))["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{p}: no usable num_hidden_layers ({e}); is `target` a decoder-only LM directory?"
        ) from None


def _family_problem(name: str) -> str | None:
    """train.draft.family names no registered draft family (eagle3.model.family)."""
    from eagle3.model.family import family_names  # torch: as read_num_layers

    if name in family_names():
        return None
    return (
        f"train.draft.family = {name!r} is not a registered draft family; use one of "
        f"{', '.join(family_names())}"
    )


def _describe(model: object, field: str) -> str:
    """What a config field holds, from its description: "held-out prompts for evaluate (...)"."""
    text = type(model).model_fields[field].description or "an existing path"
    first = text.split(";")[0].split(":")[0].rstrip(".")
    return first[:1].lower() + first[1:]


def _is_output(path: str, outputs: list[Path]) -> bool:
    """Whether `path` is (inside) a stage's output directory: the pipeline writes it."""
    p = Path(path)
    return any(p == out or out in p.parents for out in outputs)


def _input_problems(cfg: PipelineConfig) -> list[str]:
    """Every stage `eagle3 run` runs, from the stage declaration: each input from outside the
    pipeline (eagle3.stage_graph.external_inputs; the target is checked apart) exists, and each
    output it reads is made by the stage it names or is there already. Named by the pipeline field
    when the section holds its value, else by section.field."""
    c = cfg.resolved()
    outputs = [Path(getattr(c, n).out) for n in stage_names("pipeline")]
    problems: dict[str, str] = {}
    for name in (n for n in stage_names("pipeline") if c.runs(n)):
        section = getattr(c, name)
        fields = type(section).model_fields
        for field, origin in external_inputs().items():
            if field in fields and field not in PIPELINE_INPUTS:
                _external_problems(c, name, field, origin, outputs, problems)
        for field, source in STAGES[name].reads.items():
            problem = _read_problem(c, name, field, source)
            if problem:
                problems.setdefault(f"{name}.{field}", problem)
    return list(problems.values())


def _external_problems(
    c: PipelineConfig,
    stage: str,
    field: str,
    origin: str,
    outputs: list[Path],
    problems: dict[str, str],
) -> None:
    """The problems of one external input field of a running stage (a path, or a list of
    sources), each once under its name."""
    value = getattr(getattr(c, stage), field)
    pipeline_value = getattr(c, origin)
    if not value:
        if not pipeline_value:
            fix = _describe(c, origin)
            problems.setdefault(origin, f"{origin} is empty; set it to the {fix}")
        return
    paths = (
        [(field, value)]
        if isinstance(value, str)
        else [(f"{field}[{i}]", src.path) for i, src in enumerate(value)]
    )
    for label, path in paths:
        name = origin if path == pipeline_value else f"{stage}.{label}"
        if _is_output(path, outputs) or Path(path).exists():
            continue
        if name == origin:
            fix = "the " + _describe(c, origin)
        elif isinstance(value, list):
            fix = f"an existing file or directory, or remove it from {stage}.{field}"
        else:
            fix = "the " + _describe(getattr(c, stage), field)
        problems.setdefault(name, f"{name} = {path!r} does not exist; point it at {fix}")


def _read_problem(c: PipelineConfig, stage: str, field: str, source: str) -> str | None:
    """A running stage's input that reads another stage's output (eagle3.stage_graph `reads`):
    that stage must make it (or pass its own input on), unless it is there already; a value set
    in the config instead must exist."""
    upstream = STAGES.get(source.split("/")[0])
    value = getattr(getattr(c, stage), field)
    if upstream is None or not isinstance(value, str) or not value:
        return None  # "@field" (external) or a list of sources (mix): checked as inputs
    if Path(value).exists():
        return None
    if value != c.input_path(source):
        return (
            f"{stage}.{field} = {value!r} does not exist; point it at an existing "
            f"{upstream.name} output, or unset it to read the one this run makes"
        )
    if c.runs(upstream.name) or upstream.passes_on:
        return None
    return (
        f"{stage}.{field} reads {upstream.name}'s output {value!r}, which this run does not make "
        f"({upstream.enabled} is off) and is not there; turn {upstream.enabled} on, or point "
        f"{stage}.{field} at an existing {upstream.name} output"
    )


def _disk_problem(cfg: PipelineConfig, num_layers: int) -> str | None:
    """The planner's disk check for capture, once prepare's manifest gives the token count (else
    None: the capture stage checks again itself before writing)."""
    # torch (the draft model, the shard format): the flows import this module before any stage runs
    from eagle3.model.draft import text_config
    from eagle3.shards import check_capture_fits, estimate_storage

    c = cfg.resolved()
    manifest = Path(c.capture.data or "") / PreparedMeta.FILE
    if cfg.stream.enabled or not manifest.is_file():
        return None
    m = PreparedMeta.read(manifest)
    num_tokens = int(m.num_tokens or 0)
    if c.capture.limit and m.num_samples:
        num_tokens = int(num_tokens * min(1.0, c.capture.limit / m.num_samples))
    hidden = int(text_config(read_json(Path(c.target) / "config.json"))["hidden_size"])
    aux_layer_ids = AuxLayerIds.resolve(c.capture.aux_layer_ids, num_layers)
    est = estimate_storage(len(aux_layer_ids), hidden, c.capture.storage_dtype, num_tokens)
    out = Path(c.capture.out)
    if out.is_dir():  # a capture already there (a rerun, a resume) holds its bytes already
        held = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        est = dataclasses.replace(est, total_bytes=max(0, est.total_bytes - held))
    try:
        check_capture_fits(out, est, c.capture.min_free_disk_gb)
    except ValueError as e:
        return str(e)
    return None


def check_pipeline(cfg: PipelineConfig, layer_sets: list[list[int]] | None = None) -> list[str]:
    """Every problem found in `cfg` (and in the sweep's `layer_sets`), one line each; [] when it can
    run. One pass: a missing path does not hide the checks that do not need it (only those reading
    the target's config.json wait for a usable one)."""
    problems: list[str] = []
    target = Path(cfg.target)
    num_layers = None
    if not (target / "config.json").is_file():
        fix = "a model directory holding config.json" + (
            "" if cfg.build_tiny_target else " (or build_tiny_target: true for the demo)"
        )
        problems.append(f"target = {cfg.target!r} has no config.json; point it at {fix}")
    else:
        try:
            num_layers = read_num_layers(target)
        except ConfigError as e:
            problems.append(str(e))
    problems += _input_problems(cfg)
    layer_problems = []
    if num_layers is not None:
        for field, ids in (
            ("capture.aux_layer_ids", cfg.capture.aux_layer_ids),
            ("train.aux_layer_ids", cfg.train.aux_layer_ids),
            *((f"layer_sets[{i}]", list(ls)) for i, ls in enumerate(layer_sets or [])),
        ):
            last_ok = field == "train.aux_layer_ids"  # training may read the last layer (id L)
            p = None if ids is None else AuxLayerIds(tuple(ids)).problem(num_layers, field, last_ok)
            if p:
                layer_problems.append(p)
    capture_ids, train_ids = cfg.capture.aux_layer_ids, cfg.train.aux_layer_ids
    if num_layers is not None and capture_ids is not None and train_ids is not None:
        extra = [k for k in train_ids if k not in capture_ids and k != num_layers]
        if extra:
            layer_problems.append(
                f"train.aux_layer_ids = {train_ids}: id(s) {extra} are not in "
                f"capture.aux_layer_ids = {capture_ids}; capture them too or "
                "pick train.aux_layer_ids from those"
            )
    problems += layer_problems
    family = _family_problem(cfg.train.draft.family)
    if family:
        problems.append(family)
    if num_layers is not None and not layer_problems:  # the disk estimate needs valid layer ids
        disk = _disk_problem(cfg, num_layers)
        if disk:
            problems.append(disk)
    return problems


def require_pipeline(
    cfg: PipelineConfig, layer_sets: list[list[int]] | None = None, what: str = "pipeline"
) -> None:
    """Raise ConfigError listing every problem check_pipeline finds (nothing has run yet)."""
    problems = check_pipeline(cfg, layer_sets)
    if problems:
        raise ConfigError(
            f"{what} {cfg.name}: the config cannot run (checked before any stage started):\n  - "
            + "\n  - ".join(problems)
        )
