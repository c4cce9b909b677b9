"""Flow-level artifacts: the per-run pipeline summary."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from eagle3_prefect.tasks.artifacts import find_tau


def pipeline_summary(name: str, manifests: dict[str, dict[str, Any]], key: str) -> None:
    rows = []
    for i, (stage, m) in enumerate(manifests.items(), start=1):
        state = "cached" if m.get("cached") else "ran"
        rows.append(f"| {i} | {stage} | {state} | {m.get('wall_s', 0):.1f} | {m.get('slot_wait_s') or 0:.1f} | "
                    f"{m['num_files']} | "
                    f"`{m['content_sha256'][:12]}` | `{m['out']}` |")
    tau = find_tau((manifests.get("evaluate") or {}).get("result") or {})
    head = f"# pipeline {name}" + (f": τ = {tau:.3f}" if tau is not None else "")
    md = (f"{head}\n\n| # | stage | this run | stage wall s | GPU slot wait s | files | content | output |\n"
          "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if "export" in manifests:
        md += f"\nDraft: `{manifests['export']['out']}`\n"
    create_markdown_artifact(markdown=md, key=key, description=f"pipeline {name}: stages, cache hits, outputs")
