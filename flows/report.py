"""What a pipeline run shows first in the UI: its name (the config and the moment), its final state
message (the result in one line) and its summary artifact (the comparison first, then the stages,
linking the other artifacts)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact

from eagle3.console import key_figure
from eagle3_prefect.tasks.artifacts import (
    artifact_key,
    comparison_table,
    find_tau,
    method_rows,
    png_markdown,
    predicted_cell,
    serve_snippet,
    span_table,
)


def run_title(config_name: str, kind: str = "", moment: float | None = None) -> str:
    """A run's name: the config's name, what runs (nothing for the pipeline itself) and the local
    minute it started, e.g. "demo · 2026-12-04 23:18" or "demo · layer sweep · 2026-12-04 23:18"."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(moment))
    return " · ".join(p for p in (config_name, kind, when) if p)


def config_name(config: Any) -> str:
    """The `name` of a config parameter, whether the flow got the model or its JSON form."""
    name = getattr(config, "name", None)
    if name is None and isinstance(config, dict):
        name = config.get("name")
    return str(name or "eagle3")


def run_namer(kind: str = "") -> Callable[[], str]:
    """A `flow_run_name` for a flow whose `config` parameter is a pipeline config: the server
    creates a deployment's run with two random words; the flow renames it when it starts."""

    def name() -> str:
        from prefect.runtime import flow_run

        return run_title(config_name((flow_run.parameters or {}).get("config")), kind)

    name.__name__ = f"{kind.replace(' ', '_') or 'pipeline'}_run_name"
    return name


def evaluate_result_of(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    result = (manifests.get("evaluate") or {}).get("result")
    return result if isinstance(result, dict) else {}


def draft_path(manifests: dict[str, dict[str, Any]]) -> str | None:
    out = (manifests.get("export") or {}).get("out")
    return str(Path(out).resolve()) if out else None


def result_line(manifests: dict[str, dict[str, Any]]) -> str:
    """The pipeline's result in one line (the run's final state message; the UI shows its first ~70
    characters, so the comparison comes first): tokens per target step and τ of the draft vs
    n-gram, their predicted speed-ups at one request (evaluate's speedup_hardware), and the draft's
    path, e.g.

        draft 1.44 vs n-gram 1.17 tokens/target step (τ 1.45 vs 2.78); predicted on h200 TP 1 at
        one request: 1.31× (k 3) vs does not pay; draft /data/runs/demo/draft
    """
    rows = {r["method"]: r for r in method_rows(evaluate_result_of(manifests))}

    def num(v: Any, suffix: str = "") -> str:
        return "–" if v is None else f"{v:.2f}{suffix}"

    parts = []
    draft, ngram = rows.get("eagle3"), rows.get("ngram")
    if draft and draft["tokens_per_step"] is not None:
        if ngram and ngram["tokens_per_step"] is not None:
            parts.append(
                f"draft {num(draft['tokens_per_step'])} vs n-gram {num(ngram['tokens_per_step'])} "
                f"tokens/target step (τ {num(draft['tau'])} vs {num(ngram['tau'])})"
            )
            if draft["predicted_on"] is not None:
                parts.append(
                    f"predicted on {draft['predicted_on']} at one request: "
                    f"{predicted_cell(draft)} vs {predicted_cell(ngram)}"
                )
        else:
            parts.append(
                f"draft {num(draft['tokens_per_step'])} tokens/target step "
                f"(τ {num(draft['tau'])}); n-gram not measured (evaluate.compare: [ngram])"
            )
            if draft["predicted_on"] is not None:
                parts.append(
                    f"predicted on {draft['predicted_on']} at one request: {predicted_cell(draft)}"
                )
    elif "evaluate" in manifests:
        tau = find_tau(evaluate_result_of(manifests))
        parts.append(f"draft τ {tau:.2f}" if tau is not None else "evaluated (no τ in its result)")
    elif "export" in manifests:
        parts.append("not evaluated (no eval_prompts)")
    path = draft_path(manifests)
    if path:
        parts.append(f"draft {path}")
    return "; ".join(parts) or f"stages done: {', '.join(manifests) or 'none'}"


def artifact_link(key: str, text: str | None = None) -> str:
    """A markdown link to the latest artifact under `key` in the UI (its key page), or `text` (the
    key in code) when no UI address is known (the embedded API)."""
    try:
        from prefect.settings import PREFECT_UI_URL

        ui = PREFECT_UI_URL.value()
    except Exception:  # a link is a convenience
        ui = None
    text = text or f"`{key}`"
    return f"[{text}]({str(ui).rstrip('/')}/artifacts/key/{key})" if ui else text


def _s(value: Any) -> str:
    return f"{value:.0f} s" if isinstance(value, int | float) else "? s"


def crash_lines(manifests: dict[str, dict[str, Any]], takeover: dict[str, Any] | None) -> list[str]:
    """What went wrong on the way and how this run recovered, one line each: the lost run this one
    took the work dir over from, each stage run that crashed (its state message, the time it ran,
    what the next run resumed from), and each stage that resumed."""
    lines = []
    if takeover and takeover.get("flow_run"):
        closed = takeover.get("closed_task_runs") or []
        lines.append(
            f"- this run took the work dir over from flow run `{takeover['flow_run']}` "
            f"({takeover.get('state') or 'state unknown'} after {_s(takeover.get('wall_s'))}: "
            f"{takeover.get('message') or 'its process is gone'})"
            + (f"; closed its task runs left running: {', '.join(closed)}" if closed else "")
        )
    elif takeover:
        lines.append(
            f"- this run took the work dir over from {takeover.get('holder')}, which is gone"
        )
    for stage, m in manifests.items():
        if m.get("cached"):
            continue
        attempts = m.get("attempts") or []
        lost = [a for a in attempts if a.get("state") != "Completed"]
        for a in lost:
            lines.append(
                f"- {stage}: run `{a['flow_run']}` ended {a['state']} after {_s(a.get('wall_s'))} "
                f"(time lost): {a.get('message') or 'no message'}; the next run resumed from "
                f"{a.get('resumes_from') or 'its unfinished output'}"
            )
        if lost:
            lines.append(
                f"- {stage}: {len(attempts)} runs in all, the last `{attempts[-1]['flow_run']}` "
                f"{attempts[-1]['state']}; {_s(sum(a.get('wall_s') or 0 for a in lost))} lost"
            )
        elif m.get("resumed_from"):
            lines.append(
                f"- {stage}: resumed from {m['resumed_from']} (an earlier run of it did not finish)"
            )
    return lines


def pipeline_summary(
    name: str,
    manifests: dict[str, dict[str, Any]],
    key: str,
    takeover: dict[str, Any] | None = None,
    title: str | None = None,
) -> str:
    """The run's summary artifact under `key` (<name>-pipeline: the latest run of a config is always
    there): the methods side by side, the draft's path, the stages, links to the other artifacts.
    Returns the result line (`result_line`)."""
    line = result_line(manifests)
    rows = method_rows(evaluate_result_of(manifests))
    crashes = crash_lines(manifests, takeover)
    md = [
        f"# {title or name}",
        "",
        f"**{line}**",
        "",
        *methods_section(rows, manifests),
        *draft_section(manifests),
        *stage_table(name, manifests, figures_above=bool(rows)),
    ]
    if crashes:
        md += ["", "## Crashes and resumes", "", *crashes]
    md += more_section(name, manifests)
    create_markdown_artifact(
        markdown="\n".join(md) + "\n",
        key=key,
        description=f"{title or name}: {line}"[:500] + ("; crashes and resumes" if crashes else ""),
    )
    return line


def methods_section(rows: list[dict[str, Any]], manifests: dict[str, dict[str, Any]]) -> list[str]:
    """The methods side by side (evaluate's result) and the reasoning / answer spans."""
    md = []
    if rows:
        md += [
            comparison_table(rows),
            "",
            "Tokens per target step compares the methods: τ counts only the steps that drafted, "
            "and n-gram drafts only where the answer repeats its context. Predicted speed-up: the "
            "step-time model on evaluate's speedup_hardware (the experts a verification pass "
            "reads, all-reduces, the draft's steps), best k at one request; measured: this "
            "machine against plain decoding.",
            "",
        ]
    from eagle3.evaluate import SPEEDUP_CHART  # the library's evaluate package: loaded on use

    result = evaluate_result_of(manifests)
    predicted = result.get("predicted_speedup") or {}
    md += [f"- {method}: {p['summary']}" for method, p in predicted.items()]
    chart = Path(str(result.get("out") or "")) / SPEEDUP_CHART
    if predicted and chart.is_file():
        md += ["", png_markdown(chart, "predicted speed-up against k, a line per concurrency")]
    md += [""] if predicted else []
    spans = span_table(result)
    if spans:
        md += ["## reasoning and answer", "", *spans, ""]
    return md


def draft_section(manifests: dict[str, dict[str, Any]]) -> list[str]:
    """The exported draft's path and how to serve it (none when export did not run)."""
    path = draft_path(manifests)
    if not path:
        return []
    return [
        "## the draft",
        "",
        "```text",
        path,
        "```",
        "",
        "```python",
        serve_snippet(path),
        "```",
        "",
    ]


def stage_table(name: str, manifests: dict[str, dict[str, Any]], figures_above: bool) -> list[str]:
    """One row per stage: ran or cached (resumed, crashed runs), time, GPU slot wait, its key
    figure (evaluate's: the table above, when there is one)."""
    md = [
        "## stages",
        "",
        "| # | stage (its summary) | this run | time | GPU slot wait | result |",
        "|---:|---|---|---:|---:|---|",
    ]
    for i, (stage, m) in enumerate(manifests.items(), start=1):
        state = "cached" if m.get("cached") else "ran"
        if not m.get("cached") and len(m.get("attempts") or []) > 1:
            state = f"ran ({len(m['attempts'])} runs, {len(m['attempts']) - 1} crashed)"
        elif not m.get("cached") and m.get("resumed_from"):
            state = "ran (resumed)"
        wall = "–" if m.get("cached") else _s(m.get("wall_s"))
        above = stage == "evaluate" and figures_above
        figure = "above" if above else key_figure(stage, m.get("result") or {})
        link = artifact_link(artifact_key(name, stage, "summary"), stage)
        md.append(
            f"| {i} | {link} | {state} | {wall} | {_s(m.get('slot_wait_s') or 0)} | "
            f"{figure.replace('|', '/')} |"
        )
    return md


def more_section(name: str, manifests: dict[str, dict[str, Any]]) -> list[str]:
    """Links to the run's other artifacts, and the directory all stage outputs are under."""
    md = []
    others = [
        (artifact_key(name, "evaluate", "tau"), "evaluate" in manifests, "τ per category, charts"),
        (artifact_key(name, "train", "curves"), "train" in manifests, "training curves"),
        (artifact_key(name, "draft"), "export" in manifests, "the draft and how to serve it"),
    ]
    links = [f"- {artifact_link(k)}: {what}" for k, present, what in others if present]
    if links:
        md += ["", "## more", "", *links]
    outputs = [str(Path(m["out"]).resolve()) for m in manifests.values() if m.get("out")]
    if len(outputs) > 1:
        md += ["", f"Outputs: under `{os.path.commonpath(outputs)}` (one directory per stage)."]
    return md
