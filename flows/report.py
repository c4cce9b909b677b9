"""Flow-level artifacts: the per-run pipeline summary."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from eagle3_prefect.tasks.artifacts import find_tau


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
) -> None:
    rows = []
    for i, (stage, m) in enumerate(manifests.items(), start=1):
        state = "cached" if m.get("cached") else "ran"
        if not m.get("cached") and len(m.get("attempts") or []) > 1:
            state = f"ran ({len(m['attempts'])} runs, {len(m['attempts']) - 1} crashed)"
        elif not m.get("cached") and m.get("resumed_from"):
            state = "ran (resumed)"
        rows.append(
            f"| {i} | {stage} | {state} | {m.get('wall_s', 0):.1f} | "
            f"{m.get('slot_wait_s') or 0:.1f} | {m['num_files']} | "
            f"`{m['content_sha256'][:12]}` | `{m['out']}` |"
        )
    tau = find_tau((manifests.get("evaluate") or {}).get("result") or {})
    head = f"# pipeline {name}" + (f": τ = {tau:.3f}" if tau is not None else "")
    md = (
        f"{head}\n\n| # | stage | this run | stage wall s | GPU slot wait s | files | content "
        "| output |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    crashes = crash_lines(manifests, takeover)
    if crashes:
        md += "\n## Crashes and resumes\n\n" + "\n".join(crashes) + "\n"
    if "export" in manifests:
        md += f"\nDraft: `{manifests['export']['out']}`\n"
    create_markdown_artifact(
        markdown=md,
        key=key,
        description=f"pipeline {name}: stages, cache hits, outputs"
        + ("; crashes and resumes" if crashes else ""),
    )
