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
    create_markdown_artifact,
    create_progress_artifact,
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


def _metric_files(out: Path) -> list[Path]:
    return sorted(
        f
        for f in out.rglob("*.jsonl")
        if not any(q.startswith(".") for q in f.relative_to(out).parts)
    )


@_guard
def train_metrics(run_name: str, out: Path) -> None:
    """The training curves' PNGs, and where the per-step metrics are (they stay in their files: a
    hundred rows of 16-digit floats is noise where the curves tell the story)."""
    pngs = sorted(
        p
        for p in out.rglob("*.png")
        if not any(q.startswith(".") for q in p.relative_to(out).parts)
    )
    files = _metric_files(out)
    if not pngs and not files:
        return
    md = "# training curves\n\n" + "\n\n".join(png_markdown(p, p.stem) for p in pngs[:6])
    if files:
        md += "\n\nPer-step metrics (JSON lines): " + ", ".join(f"`{f}`" for f in files)
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


#: how the summary and the evaluate artifact name the methods of an evaluate result
METHOD_LABELS = {"eagle3": "draft (EAGLE-3)", "ngram": "n-gram", "plain": "plain decoding"}


def _round(v: Any, digits: int = 2) -> float | None:
    return round(float(v), digits) if _is_number(v) else None


def method_rows(result: dict[str, Any] | Any) -> list[dict[str, Any]]:
    """The methods an evaluate result measured, side by side over every prompt at its first
    temperature: the evaluated method, those of `compare` (n-gram), then plain decoding when its
    speed was timed. Each row: method (eagle3, ngram, plain), tokens_per_step (generated tokens per
    target forward pass: the figure that compares methods), tau (vLLM's mean acceptance length over
    the steps that drafted; None where it never drafted), drafted (the fraction of steps that
    drafted), tokens_per_s, predicted_speedup and predicted_k (the best k and its speed-up at one
    request on evaluate's speedup_hardware, eagle3.speedup; predicted_k None where speculation does
    not pay), predicted_on (that hardware and tensor parallel size), measured_speedup (against
    plain decoding, on this machine). Rounded; None where the result does not say. [] when the
    result is not an evaluate result."""
    from eagle3.artifacts import EvalResults

    try:
        r = EvalResults.from_dict(result, "the evaluate result")
    except (ValueError, TypeError):
        return []
    first = r.all_row()
    runs = [(r.method, first)]
    seen = {r.method}
    for c in r.comparisons:  # their row over every prompt at the first temperature
        if c.category == "all" and c.method not in seen:
            seen.add(c.method)
            runs.append((c.method, c))
    rows = []
    for method, row in runs:
        gen = row.generated_tokens if row is not None else None
        acc = row.num_accepted_tokens if row is not None else r.num_accepted_tokens
        drafts = row.num_drafts if row is not None else r.num_drafts
        steps = gen - acc if gen is not None and acc is not None else None
        tau = row.tau if row is not None else r.acceptance_length
        rows.append(
            {
                "method": method,
                "tokens_per_step": _round(gen / steps if steps else None),
                "tau": _round(tau) if drafts or row is None else None,
                "drafted": _round(
                    min(drafts / steps, 1.0) if steps and drafts is not None else None
                ),
                "tokens_per_s": _round(
                    row.tokens_per_s if row is not None else r.spec_tokens_per_s, 1
                ),
                **_predicted_at_one_request(r.predicted_speedup, method),
                "measured_speedup": _round(row.measured_speedup if row is not None else r.speedup),
            }
        )
    plain_tps = (first.baseline_tokens_per_s if first is not None else None) or (
        r.baseline_tokens_per_s
    )
    if plain_tps:
        rows.append(
            {
                "method": "plain",
                "tokens_per_step": 1.0,
                "tau": None,
                "drafted": 0.0,
                "tokens_per_s": _round(plain_tps, 1),
                "predicted_speedup": 1.0,
                "predicted_k": None,
                "predicted_on": None,
                "measured_speedup": 1.0,
            }
        )
    return rows


def _predicted_at_one_request(predicted: dict[str, Any] | None, method: str) -> dict[str, Any]:
    """The best k at one request and its predicted speed-up (the row of the k that pays most,
    even where none pays), from an evaluate result's `predicted_speedup`."""
    p = (predicted or {}).get(method)
    if not p:
        return {"predicted_speedup": None, "predicted_k": None, "predicted_on": None}
    ones = [r for r in p["rows"] if r["concurrency"] == 1]
    best = max(ones, key=lambda r: r["speedup"]) if ones else None
    return {
        "predicted_speedup": _round(best["speedup"]) if best else None,
        "predicted_k": p["recommended_k"].get("1"),
        "predicted_on": f"{p['hardware']} TP {p['tensor_parallel_size']}",
    }


def predicted_cell(row: dict[str, Any]) -> str:
    """×1.38 (k 3), "does not pay" or a dash: a method_rows row's prediction at one request."""
    if row.get("predicted_speedup") is None:
        return "–"
    if row["method"] == "plain":
        return "1.00×"
    if row.get("predicted_k") is None:
        return "does not pay"
    return f"{row['predicted_speedup']:.2f}× (k {row['predicted_k']})"


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """`method_rows` as a markdown table a person reads: two decimals, a dash where not measured."""

    def cell(v: Any, fmt: str) -> str:
        return "–" if v is None else fmt.format(v)

    on = next((f", {r['predicted_on']}" for r in rows if r.get("predicted_on")), "")
    lines = [
        "| method | tokens / target step | τ | steps drafted | tokens/s | predicted speed-up "
        f"(1 request{on}) | measured speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {METHOD_LABELS.get(r['method'], r['method'])} "
            f"| {cell(r['tokens_per_step'], '{:.2f}')} | {cell(r['tau'], '{:.2f}')} "
            f"| {cell(r['drafted'], '{:.0%}')} | {cell(r['tokens_per_s'], '{:.1f}')} "
            f"| {predicted_cell(r)} "
            f"| {cell(r['measured_speedup'], '{:.2f}×')} |"
        )
    return "\n".join(lines)


def span_table(result: dict[str, Any] | Any) -> list[str]:
    """A thinking target's tokens per target step on the reasoning span and on the answer span,
    per method and temperature, as markdown lines; [] when the evaluation did not split them."""
    from eagle3.artifacts import EvalResults
    from eagle3.evaluate import format_span_rows

    try:
        r = EvalResults.from_dict(result, "the evaluate result")
    except (ValueError, TypeError):
        return []
    return format_span_rows(r.span_rows) if r.span_rows else []


def _load_result(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The stage's result, completed from its results.json (a stand-in or an older stage may return
    less)."""
    data = dict(result)
    results_json = out / "results.json"
    if results_json.is_file():
        try:
            data = {**json.loads(results_json.read_text()), **data}
        except json.JSONDecodeError:
            pass
    return data


@_guard
def evaluate_result(run_name: str, out: Path, result: dict[str, Any]) -> None:
    """The methods side by side (tokens per target step, τ, speed), τ per category and temperature,
    per-position acceptance and the charts; the full tables stay in results.md / results.json."""
    data = _load_result(out, result)
    tau = find_tau(data)
    lines = [f"# evaluate: τ = {tau:.2f}" if tau is not None else "# evaluate", ""]
    rows = method_rows(data)
    if rows:
        lines += [comparison_table(rows), ""]
    spans = span_table(data)
    if spans:
        lines += ["## reasoning and answer", "", *spans, ""]
    categories = [
        r for r in data.get("rows") or [] if isinstance(r, dict) and r.get("category") != "all"
    ]
    if categories:
        lines += [
            "## per category",
            "",
            "| category | temperature | prompts | tokens / target step | τ |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in categories:
            lines.append(
                f"| {r.get('category')} | {r.get('temperature')} | {r.get('num_prompts')} | "
                + " | ".join(
                    "–" if _round(r.get(k)) is None else f"{_round(r.get(k)):.2f}"
                    for k in ("tokens_per_step", "tau")
                )
                + " |"
            )
        lines.append("")
    for p in (data.get("predicted_speedup") or {}).values():
        if isinstance(p, dict) and p.get("table_markdown"):
            lines += ["## predicted speed-up", "", p["table_markdown"], ""]
    per_pos = find_per_position(data)
    if per_pos:
        lines += ["| draft position | acceptance |", "|---:|---:|"]
        lines += [f"| {i + 1} | {a:.2f} |" for i, a in enumerate(per_pos)]
        lines.append("")
    files = [f for f in (out / "results.md", out / "results.json") if f.is_file()]
    if files:
        lines += ["Every row and field: " + ", ".join(f"`{f}`" for f in files), ""]
    lines += [png_markdown(p, p.stem) for p in sorted(out.glob("*.png"))]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=artifact_key(run_name, "evaluate", "tau"),
        description="tokens per target step and τ, draft vs n-gram"
        if len(rows) > 1
        else f"mean acceptance length τ = {tau}",
    )


def serve_snippet(draft: str | Path) -> str:
    """The vLLM line that serves the draft at `draft`."""
    return (
        "LLM(\n    model=TARGET,\n    speculative_config={\n"
        f'        "method": "eagle3",\n        "model": "{draft}",\n'
        '        "num_speculative_tokens": 3,\n    },\n)'
    )


@_guard
def exported_draft(run_name: str, out: Path) -> None:
    """Where the exported draft is (a path to copy: a browser does not open file:// links from the
    UI) and the vLLM line that serves it."""
    path = out.resolve()
    md = (
        f"# exported draft\n\n```text\n{path}\n```\n\nServe it with vLLM:\n\n```python\n"
        f"{serve_snippet(path)}\n```\n"
    )
    create_markdown_artifact(
        markdown=md,
        key=artifact_key(run_name, "draft"),
        description=f"exported EAGLE-3 draft: {path}",
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
