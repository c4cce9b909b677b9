"""What a person at a terminal sees: quiet by default, everything with `-v/--verbose`.

Quiet (the default of the `eagle3` command):
  * vLLM logs errors only (VLLM_LOGGING_LEVEL, inherited by the engine processes);
  * Prefect's console shows warnings and errors only (PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL): no
    "Starting temporary server", no task state lines; the stages' own output, which the Prefect
    layer copies into the task log at INFO, stays in the run's log in the Prefect API / UI (a stage
    line the child logged at WARNING or above is copied at WARNING, so it shows here too);
  * transformers and the Python `logging` tree show warnings and errors, without the progress bars
    of transformers / huggingface_hub / datasets;
  * each pipeline stage prints one progress line (logger `eagle3.progress`, always on), and `eagle3
    run` ends on `format_summary`'s table instead of the manifests' JSON.
Verbose: every library's INFO logging, as before.

Only environment defaults are set (`setdefault`): a variable the user exported wins. This module
imports neither vLLM nor Prefect; it must run before either is imported, so the CLI calls it first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.artifacts import EvalResults

PROGRESS = "eagle3.progress"

#: environment for a quiet run; verbose sets none of them
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    # Prefect's console handler only: its loggers stay at INFO, so the run's log in the Prefect
    # API/UI still holds every stage's output
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "TRANSFORMERS_VERBOSITY": "error",
    # progress bars of the stages that run in this process (fetch-target's GGUF conversion,
    # prepare's dataset save): transformers follows huggingface_hub's switch, datasets has its own
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def configure_output(verbose: bool = False) -> None:
    """Set the log levels of this process (and, through the environment, of its stage
    subprocesses)."""
    if not verbose:
        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)
    level = "INFO" if verbose else "WARNING"
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.setLevel(
            level
        )  # libraries that set their own logger's level (Prefect: INFO) propagate here
        root.addHandler(handler)
    root.setLevel(level)
    progress = logging.getLogger(PROGRESS)  # the one line per stage: on in both modes, plain text
    progress.setLevel(logging.INFO)
    progress.propagate = False
    if not progress.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        progress.addHandler(h)


# -------------------------------------------------------------------------------------- stage lines
def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.3g}" if x < 100 else f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def key_figure(stage: str, result: Any) -> str:
    """The one number that says what a stage did, from its result (dataclass or its JSON form)."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        r = dataclasses.asdict(result)  # nested rows stay records; evaluate_figure reads both
    else:
        r = result if isinstance(result, dict) else getattr(result, "__dict__", {}) or {}
    g = r.get
    try:
        if stage == "fetch-target":
            return (
                f"{g('name')} ({g('dtype')}) {'reused' if g('reused') else 'converted'} at "
                f"{g('out')}"
            )
        if stage == "regenerate":
            return (
                f"{_num(g('num_written'))} conversations, {_num(g('generated_tokens'))} tokens "
                "generated"
                + _reasoning_figure(g("reasoning_tokens"), g("generated_tokens"))
                + _truncated_figure(g("truncated_share"))
            )
        if stage == "prepare":
            turns = g("turns") or {}
            ids = turns.get("from_generated", 0)
            text = f", {ids:,} of {ids + turns.get('from_text', 0):,} turns as generated ids"
            return (
                f"{_num(g('num_samples'))} rows, {_num(g('num_tokens'))} tokens"
                + (text if ids else "")
                + _reasoning_figure(
                    turns.get("reasoning_tokens"),
                    (turns.get("reasoning_tokens") or 0) + (turns.get("answer_tokens") or 0),
                )
            )
        if stage in ("capture", "stream-capture"):
            return f"{_num(g('num_tokens'))} tokens at {_num(g('tokens_per_s'))} tokens/s"
        if stage == "vocab":
            return f"{_num(g('draft_vocab_size'))} draft tokens, coverage {g('coverage', 0):.3f}"
        if stage in ("train", "stream-train", "stream"):
            val = g("val_metrics") or {}
            acc = next((v for k, v in val.items() if k.startswith("acc")), None)
            tail = f", val acc@1 {acc:.3f}" if isinstance(acc, float) else ""
            return f"{_num(g('steps'))} steps, loss {g('train_loss') or float('nan'):.3f}{tail}"
        if stage == "refine":
            before, after = (g("tau_before") or {}).get("all"), (g("tau_after") or {}).get("all")
            return (
                f"{g('num_rounds')} round(s), {_num(g('num_rejected_blocks'))} rejected "
                f"blocks, validation τ {before:.3f} -> {after:.3f} (round "
                f"{g('selected_round')})"
            )
        if stage == "export":
            return f"{g('format')} draft"
        if stage == "evaluate":
            return evaluate_figure(r)
    except (TypeError, ValueError):
        pass
    return ""


def _reasoning_figure(reasoning_tokens: Any, tokens: Any) -> str:
    """ ", 71% reasoning" when a thinking target's turns hold reasoning tokens."""
    if not reasoning_tokens or not tokens:
        return ""
    return f", {reasoning_tokens / tokens:.0%} reasoning"


def _truncated_figure(share: Any) -> str:
    """ ", 12% cut at max_new_tokens" (the largest source's share) when any turn was cut."""
    worst = max((share or {}).values(), default=0)
    return f", {worst:.0%} cut at max_new_tokens" if worst else ""


def format_bytes(b: float) -> str:
    """`b` bytes in the largest decimal unit that keeps it >= 1 (1.23 GB)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def tokens_per_target_step(generated_tokens: int, accepted_tokens: int) -> float:
    """Generated tokens per target forward pass: every pass (the prefill included) emits one token
    plus the draft tokens it accepted, so passes = generated - accepted. Unlike vLLM's mean
    acceptance length (counted over the passes that drafted), this counts the passes where a method
    proposed nothing (n-gram when no match), so different methods compare on it. NaN where no pass
    ran."""
    steps = generated_tokens - accepted_tokens
    return generated_tokens / steps if steps > 0 else float("nan")


def evaluate_figure(result: dict[str, Any] | EvalResults) -> str:
    r = EvalResults.from_dict(result, "the evaluate result")
    tau = r.acceptance_length
    row = r.all_row()
    parts = [f"τ {tau:.2f}" if tau is not None else "τ -"]
    gen = row.generated_tokens if row is not None else None
    acc = row.num_accepted_tokens if row is not None else r.num_accepted_tokens
    if gen is not None and acc is not None:
        parts.append(f"{tokens_per_target_step(gen, acc):.2f} tokens/target step")
    if r.spec_tokens_per_s:
        parts.append(f"{r.spec_tokens_per_s:.0f} tokens/s")
    if r.baseline_tokens_per_s:
        parts.append(f"plain {r.baseline_tokens_per_s:.0f} tokens/s")
    parts += _span_figures(r, r.method)
    predicted = (r.predicted_speedup or {}).get(r.method)
    if predicted:
        parts.append(predicted["summary"])
    compared = []
    for e in comparison_entries(r)[
        1:
    ]:  # the methods of evaluate's `compare`, after the evaluated one
        tau_c = f"τ {e['tau']:.2f}" if e["tau"] is not None else "τ -"
        tps = tokens_per_target_step(e["generated_tokens"], e["num_accepted_tokens"])
        compared.append(
            ", ".join(
                [
                    f"{e['method']} {tau_c}, {tps:.2f} tokens/target step, "
                    f"{e['tokens_per_s']:.0f} tokens/s",
                    *_span_figures(r, e["method"]),
                ]
            )
        )
    return " | ".join([", ".join(parts), *compared])


def _span_figures(r: EvalResults, method: str) -> list[str]:
    """["reasoning 2.31", "answer 2.02"]: tokens per target step of `method` on each span of a
    thinking target's turns (first temperature, every prompt); [] when not split."""
    first = r.rows[0].temperature if r.rows else None
    return [
        f"{x.span} {x.tokens_per_step:.2f}"
        for x in r.span_rows
        if x.method == method
        and x.category == "all"
        and x.temperature == first
        and x.tokens_per_step
    ]


def comparison_entries(r: EvalResults) -> list[dict[str, Any]]:
    """One entry per method of an evaluate result (results.json or the stage's result): the
    evaluated method's row over every prompt at the first temperature, then that row of each method
    in its `comparisons` (evaluate's `compare`). Entry: method, tau (None where it never drafted),
    generated_tokens, num_accepted_tokens, num_drafts, tokens_per_s."""
    row = r.all_row()
    drafts = int((row.num_drafts if row is not None else None) or r.num_drafts or 0)
    tau = r.acceptance_length
    acc = row.num_accepted_tokens if row is not None else r.num_accepted_tokens
    out = [
        {
            "method": r.method,
            "tau": tau if tau is not None and drafts else None,
            "generated_tokens": int((row.generated_tokens if row is not None else None) or 0),
            "num_accepted_tokens": int(acc or 0),
            "num_drafts": drafts,
            "tokens_per_s": (row.tokens_per_s if row is not None else None)
            or r.spec_tokens_per_s
            or 0.0,
        }
    ]
    seen = set()
    for c in r.comparisons:
        if c.category != "all" or c.method in seen:
            continue
        seen.add(c.method)
        out.append(
            {
                "method": c.method,
                "tau": c.tau if c.num_drafts else None,
                "generated_tokens": int(c.generated_tokens or 0),
                "num_accepted_tokens": int(c.num_accepted_tokens or 0),
                "num_drafts": int(c.num_drafts or 0),
                "tokens_per_s": c.tokens_per_s or 0.0,
            }
        )
    return out


def format_comparison(entries: list[dict[str, Any]]) -> str:
    """`comparison_entries` side by side: τ as vLLM reports it (over the steps that drafted),
    generated tokens per target forward pass (every step: the figure that compares methods, since
    n-gram drafts only where the text repeats), the fraction of steps that drafted, and decode
    speed."""
    lines = [
        f"  {'method':<8} {'τ (drafting steps)':>18} {'tokens / target step':>21} "
        f"{'steps drafted':>14} {'tokens/s':>9}"
    ]
    for e in entries:
        gen, acc = e["generated_tokens"], e["num_accepted_tokens"]
        steps = gen - acc
        tau_txt = f"{e['tau']:.2f}" if e["tau"] is not None else "-"
        lines.append(
            f"  {e['method']:<8} {tau_txt:>18} {tokens_per_target_step(gen, acc):>21.2f} "
            f"{(e['num_drafts'] / steps if steps > 0 else 0):>13.0%} {e['tokens_per_s']:>9.1f}"
        )
    return "\n".join(lines)


def compare_methods(results: list[str | Path]) -> str:
    """Side by side, from evaluate's results.json files (same prompts): each file's method, then the
    methods it measured beside it (`compare`); one directory evaluated with `compare: [ngram]` is
    enough, and directories of separate evaluations (one method each) still compare."""
    entries = []
    for path in results:
        entries += comparison_entries(EvalResults.load(path))
    return format_comparison(entries)


if __name__ == "__main__":  # python -m eagle3.console compare RESULTS [RESULTS ...]
    if len(sys.argv) < 3 or sys.argv[1] != "compare":
        sys.exit("usage: python -m eagle3.console compare EVALUATE_DIR_OR_RESULTS_JSON [...]")
    print(compare_methods(sys.argv[2:]))


class StageLine:
    """`with StageLine("capture", index, total) as line: ...; line.done(result, cached=False)`: one
    line per stage on stderr (on a terminal the start line is overwritten by the end line)."""

    def __init__(self, stage: str, index: int, total: int):
        self.stage, self.index, self.total = stage, index, total
        self.log = logging.getLogger(PROGRESS)
        self.tty = sys.stderr.isatty()
        self.t0 = time.time()
        self.wall_s: float | None = None

    def __enter__(self) -> StageLine:
        head = f"[{self.index}/{self.total}] {self.stage:<10}"
        if self.tty:
            sys.stderr.write(f"{head} running …\r")
            sys.stderr.flush()
        else:
            self.log.info("%s running …", head)
        return self

    def done(self, result: Any = None, cached: bool = False, wall_s: float | None = None) -> None:
        self.wall_s = wall_s if wall_s is not None else time.time() - self.t0
        fig = key_figure(self.stage, result)
        how = "cached" if cached else "ran"
        clear = "\x1b[2K" if self.tty else ""
        self.log.info(
            "%s[%d/%d] %-10s %-6s %7.1f s  %s",
            clear,
            self.index,
            self.total,
            self.stage,
            how,
            self.wall_s,
            fig,
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            clear = "\x1b[2K" if self.tty else ""
            self.log.info(
                "%s[%d/%d] %-10s failed after %.1f s",
                clear,
                self.index,
                self.total,
                self.stage,
                time.time() - self.t0,
            )


# -------------------------------------------------------------------------------------- the summary
def format_summary(
    name: str, rows: list[dict[str, Any]], work_dir: str | Path, where: dict[str, str] | None = None
) -> str:
    """The table `eagle3 run` ends on. rows: {"stage", "wall_s", "cached", "figure"} in stage
    order."""
    lines = [
        f"eagle3 pipeline {name!r}: {len(rows)} stages, "
        f"{sum(1 for r in rows if not r.get('cached'))} ran, "
        f"{sum(1 for r in rows if r.get('cached'))} cached",
        "",
    ]
    w = max([len("stage"), *(len(r["stage"]) for r in rows)])
    lines.append(f"  {'stage':<{w}}  {'wall':>8}  {'':6}  key figure")
    for r in rows:
        wall = r.get("wall_s")
        wall_txt = (
            f"{wall:7.1f}s" if isinstance(wall, int | float) and not r.get("cached") else "       -"
        )
        lines.append(
            f"  {r['stage']:<{w}}  {wall_txt}  {'cached' if r.get('cached') else 'ran':6}  "
            f"{r.get('figure', '')}"
        )
    total = sum(r.get("wall_s") or 0 for r in rows if not r.get("cached"))
    lines.append(f"  {'total':<{w}}  {total:7.1f}s")
    lines.append("")
    lines.append(f"  outputs   {Path(work_dir)}/ (one directory per stage)")
    for k, v in (where or {}).items():
        lines.append(f"  {k:<9} {v}")
    return "\n".join(lines)


def summary_rows(
    manifests: dict[str, Any], wall_s: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Rows for format_summary from the flow's {stage: manifest} (or run_pipeline's stages +
    wall_s)."""
    rows = []
    for stage, m in manifests.items():
        if isinstance(m, dict) and "result" in m and "stage" in m:  # a Prefect stage manifest
            result, cached, wall = m.get("result") or {}, bool(m.get("cached")), m.get("wall_s")
        else:
            result, cached, wall = m, False, (wall_s or {}).get(stage)
        rows.append(
            {"stage": stage, "wall_s": wall, "cached": cached, "figure": key_figure(stage, result)}
        )
    return rows
