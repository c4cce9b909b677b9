"""Prefect artifacts for the stages: what a person looks at in the UI after a run.

Every function here reads files the stage wrote; none of them can fail the stage (errors are
logged).
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

log = logging.getLogger("eagle3.tasks.artifacts")

#: PNGs up to this size are embedded in markdown artifacts (data URI); larger ones are linked by
#: path
EMBED_PNG_MAX_BYTES = 400_000


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    key = "-".join(parts).lower()
    return re.sub(r"[^a-z0-9-]+", "-", key).strip("-")[:100] or "eagle3"


def _guard(fn):
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # artifacts are reporting, never a failure
            log.warning("artifact %s failed: %s", fn.__name__, e)
            return None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        text = json.dumps(v, default=str)
        return text if len(text) <= 120 else text[:117] + "..."
    return str(v)


def png_markdown(path: Path, alt: str) -> str:
    if path.is_file() and path.stat().st_size <= EMBED_PNG_MAX_BYTES:
        data = base64.b64encode(path.read_bytes()).decode()
        return f"![{alt}](data:image/png;base64,{data})\n\n`{path}`"
    return f"`{path}` ({alt})"


@_guard
def stage_summary(run_name: str, manifest: dict[str, Any], action: str) -> None:
    """Markdown summary of one stage run: key, output, content hash, the library's result fields."""
    result = manifest.get("result") or {}
    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in result.items())
    md = (
        f"# {manifest['stage']} ({run_name})\n\n"
        f"- output: `{manifest['out']}`\n- cache key: `{manifest['key']}`\n"
        f"- content sha256: `{manifest['content_sha256']}`\n"
        f"- files: {manifest['num_files']} ({manifest['num_bytes'] / 1e6:.2f} MB)\n"
        f"- wall time: {manifest['wall_s']:.1f} s\n- before the run: {action}\n"
        + (f"- resumed from: {manifest['resumed_from']}\n" if manifest.get("resumed_from") else "")
        + "\n"
        f"| field | value |\n|---|---|\n{rows}\n"
    )
    create_markdown_artifact(
        markdown=md,
        key=artifact_key(run_name, manifest["stage"], "summary"),
        description=f"{manifest['stage']} stage summary",
    )


class Progress:
    """A progress artifact (0-100 %) for a long stage."""

    def __init__(self, run_name: str, stage: str):
        self.id = None
        try:
            self.id = create_progress_artifact(
                progress=0.0,
                key=artifact_key(run_name, stage, "progress"),
                description=f"{stage} progress",
            )
        except Exception as e:
            log.warning("progress artifact failed: %s", e)

    def update(self, fraction: float) -> None:
        if self.id is None:
            return
        try:
            update_progress_artifact(
                self.id, progress=round(100.0 * min(max(fraction, 0.0), 1.0), 1)
            )
        except Exception as e:
            log.warning("progress update failed: %s", e)


def read_metric_rows(out: Path) -> list[dict[str, Any]]:
    """Per-step training metrics: every JSON line with a `step` field in the *.jsonl files under out
    (the train stage's metrics log), sorted by step."""
    rows: list[dict[str, Any]] = []
    for f in sorted(out.rglob("*.jsonl")):
        if any(p.startswith(".") for p in f.relative_to(out).parts):
            continue
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                rows.append(rec)
    rows.sort(key=lambda r: (r.get("step", 0), str(r.get("split", ""))))
    return rows


@_guard
def train_metrics(run_name: str, out: Path, max_rows: int = 500) -> None:
    """Table of per-step training metrics, plus the training curves' PNGs."""
    rows = read_metric_rows(out)
    if rows:
        if len(rows) > max_rows:  # keep the first, the last and an even spread
            stride = len(rows) / max_rows
            rows = [rows[int(i * stride)] for i in range(max_rows - 1)] + [rows[-1]]
        cols: list[str] = []
        for r in rows:
            cols += [k for k in r if k not in cols and not isinstance(r[k], dict | list)]
        table = [{c: r.get(c) for c in cols} for r in rows]
        create_table_artifact(
            table=table,
            key=artifact_key(run_name, "train", "metrics"),
            description="per-step training metrics",
        )
    pngs = sorted(
        p
        for p in out.rglob("*.png")
        if not any(q.startswith(".") for q in p.relative_to(out).parts)
    )
    if pngs:
        md = "# training curves\n\n" + "\n\n".join(png_markdown(p, p.stem) for p in pngs[:6])
        create_markdown_artifact(
            markdown=md,
            key=artifact_key(run_name, "train", "curves"),
            description="training curves",
        )


def find_value(result: dict[str, Any], keys: tuple[str, ...], accept: Callable[[Any], bool]) -> Any:
    """The first value under one of `keys` that `accept`s, searching nested dicts depth-first."""
    for key in keys:
        if key in result and accept(result[key]):
            return result[key]
    for v in result.values():
        if isinstance(v, dict):
            found = find_value(v, keys, accept)
            if found is not None:
                return found
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def find_tau(result: dict[str, Any]) -> float | None:
    """The mean acceptance length τ from an evaluate result (nested allowed)."""
    v = find_value(result, ("tau", "mean_acceptance_length", "acceptance_length"), _is_number)
    return None if v is None else float(v)


def find_per_position(result: dict[str, Any]) -> list[float] | None:
    v = find_value(
        result,
        ("acceptance_rate_per_position", "per_position_acceptance"),
        lambda x: isinstance(x, list) and all(_is_number(y) for y in x),
    )
    return None if v is None else [float(x) for x in v]


@_guard
def evaluate_result(run_name: str, out: Path, result: dict[str, Any]) -> None:
    """τ (mean acceptance length), per-position acceptance, speed-up and the charts."""
    data = dict(result)
    results_json = out / "results.json"
    if results_json.is_file():
        try:
            data = {**json.loads(results_json.read_text()), **data}
        except json.JSONDecodeError:
            pass
    tau = find_tau(data)
    per_pos = find_per_position(data)
    lines = [f"# τ = {tau:.3f}" if tau is not None else "# evaluate", ""]
    if per_pos:
        lines += ["| position | acceptance |", "|---|---|"]
        lines += [f"| {i + 1} | {a:.3f} |" for i, a in enumerate(per_pos)]
        lines.append("")
    if (out / "results.md").is_file():  # τ per category and temperature, the draft's cost
        lines += [(out / "results.md").read_text().replace("# evaluate", "## evaluate", 1), ""]
    scalars = {k: v for k, v in data.items() if isinstance(v, int | float | str) and k != "out"}
    if scalars:
        lines += ["| field | value |", "|---|---|"] + [
            f"| {k} | {_fmt(v)} |" for k, v in scalars.items()
        ]
    pngs = sorted(out.glob("*.png"))
    lines += [""] + [png_markdown(p, p.stem) for p in pngs]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=artifact_key(run_name, "evaluate", "tau"),
        description=f"mean acceptance length τ = {tau}",
    )


@_guard
def exported_draft(run_name: str, out: Path) -> None:
    """Link to the exported draft directory and the vLLM line that serves it."""
    create_link_artifact(
        link=out.resolve().as_uri(),
        link_text=str(out.resolve()),
        key=artifact_key(run_name, "draft"),
        description="exported EAGLE-3 draft",
    )
    md = (
        f"# exported draft\n\n`{out.resolve()}`\n\n```python\n"
        f'LLM(model=TARGET, speculative_config={{"method": "eagle3", "model": "{out.resolve()}", '
        f'"num_speculative_tokens": 3}})\n```\n'
    )
    create_markdown_artifact(
        markdown=md,
        key=artifact_key(run_name, "draft", "usage"),
        description="how to serve the draft",
    )


def stage_reports(run_name: str, manifest: dict[str, Any]) -> None:
    """The report artifacts of one stage (training curves and metrics, τ and its chart, the draft),
    made in the calling run from the files the stage wrote: a pipeline run shows them although its
    GPU stages ran as runs of their own (or were cached)."""
    stage, out = manifest.get("stage"), Path(manifest.get("out") or "")
    if stage == "train":
        train_metrics(run_name, out)
    elif stage == "evaluate":
        result = manifest.get("result")
        evaluate_result(run_name, out, result if isinstance(result, dict) else {})
    elif stage == "export":
        exported_draft(run_name, out)
