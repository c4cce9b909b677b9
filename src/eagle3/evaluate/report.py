"""What an evaluation writes for a person: results.md (the rows as tables) and acceptance.png
(the per-position acceptance chart)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3.artifacts import EvalResults
from eagle3.console import comparison_entries, format_comparison
from eagle3.evaluate.rows import CategoryResult, EvaluateResult
from eagle3.io import atomic_path

RESULTS = EvalResults.FILE
CHART = "acceptance.png"
SPEEDUP_CHART = "speedup.png"


def plot_acceptance(
    path: Path, rates: list[float], counts: list[int], tau: float, k: int, title: str
) -> None:
    """acceptance.png: accepted / drafts per draft position (count beside each bar), τ in the
    title; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * k + 3, 3.6), dpi=110)
    xs = list(range(1, len(rates) + 1))
    bars = ax.bar(xs, rates, color="#3b75af")
    for b, r, c in zip(bars, rates, counts, strict=True):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height() + 0.01,
            f"{r:.2f}\n({c})",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.15)
    ax.set_title(f"{title}\nτ = {tau:.3f} (k = {k}, max {k + 1})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def plot_speedup(path: Path, predicted: dict[str, Any], target: str) -> None:
    """speedup.png: the predicted speed-up against k, one line per concurrency, a panel per
    method, the no-speculation line at 1; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(predicted)
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.4), dpi=110,
                             squeeze=False)  # fmt: skip
    for ax, m in zip(axes[0], methods, strict=True):
        p = predicted[m]
        for c in sorted({r["concurrency"] for r in p["rows"]}):
            rows = [r for r in p["rows"] if r["concurrency"] == c]
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o", ms=3,
                    label=f"{c} in flight")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("predicted speed-up")
        ax.set_title(
            f"{m}: {target} on {p['hardware']}, TP {p['tensor_parallel_size']}", fontsize=8
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def format_rows(result: EvaluateResult) -> str:
    """results.md: the rows as a markdown table, with the cost line under it."""
    c = result.draft_cost
    lines = [
        f"# evaluate: {result.method}, k = {result.num_speculative_tokens}\n",
        f"Draft cost: {c.get('draft_params', 0):,} parameters ({100 * c.get('param_ratio', 0):.2f} "
        f"% of the target's {c.get('target_params', 0):,}); FLOPs of one round (k draft steps) / "
        f"one target token = {c.get('flops_ratio', 0):.3f}.\n",
        "| method | category | temperature | prompts | τ | tokens per target step | tokens/s | "
        "baseline tokens/s | measured speed-up | greedy outputs = baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x: Any, fmt: str = "{:.3f}") -> str:
        return "–" if x is None else fmt.format(x)

    for r in result.rows + result.comparisons:
        lines.append(
            f"| {r.method} | {r.category} | {r.temperature:g} | {r.num_prompts} | {f(r.tau)} | "
            f"{f(r.tokens_per_step)} | "
            f"{f(r.tokens_per_s, '{:.1f}')} | {f(r.baseline_tokens_per_s, '{:.1f}')} | "
            f"{f(r.measured_speedup)} | {f(r.outputs_match_baseline, '{:.2f}')} |"
        )
    if result.span_rows:
        lines += ["", *format_span_rows(result.span_rows)]
    for p in (result.predicted_speedup or {}).values():
        lines += ["", p["table_markdown"].rstrip()]
    if result.comparisons:
        first = next(r.temperature for r in result.rows if r.category == "all")
        lines += [
            "",
            f"Side by side, every prompt at temperature {first:g} (τ counts only the steps that "
            "drafted, tokens per target step counts every step):",
            "",
            "```",
            format_comparison(
                comparison_entries(EvalResults.from_dict(asdict(result), str(result.out)))
            ),
            "```",
        ]
    return "\n".join(lines) + "\n"


def format_span_rows(rows: list[CategoryResult]) -> list[str]:
    """Tokens per target step of each method on the reasoning span and on the answer span, every
    category ("all"), per temperature: the table for thinking targets."""
    methods = list(dict.fromkeys(r.method for r in rows))
    keys = list(dict.fromkeys((r.temperature, r.span) for r in rows if r.category == "all"))
    got = {(r.method, r.temperature, r.span): r for r in rows if r.category == "all"}
    out = [
        "Tokens per target step on the reasoning span (the think block) and the answer span:",
        "",
        "| temperature | span | " + " | ".join(methods) + " | prompts |",
        "|---:|---|" + "---:|" * len(methods) + "---:|",
    ]
    for t, span in keys:
        cells = [got.get((m, t, span)) for m in methods]
        vals = [f"{c.tokens_per_step:.3f}" if c and c.tokens_per_step else "–" for c in cells]
        n = next((c.num_prompts for c in cells if c), 0)
        out.append(f"| {t:g} | {span} | " + " | ".join(vals) + f" | {n} |")
    return out
