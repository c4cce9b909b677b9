"""The results of an evaluation from its engines' counters: one row per (category, temperature),
an "all" row per temperature, a thinking target's rows per span, and the headline figures (the
first temperature's "all" row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.artifacts import EvalRow
from eagle3.evaluate.cost import tokens_per_target_step
from eagle3.evaluate.engine import M_ACCEPTED, M_DRAFT_TOKENS, M_DRAFTS, M_PER_POS


@dataclass
class DecodeRun:
    """One engine's timed pass over the prompts (the first temperature, all categories)."""

    speculative: bool
    num_prompts: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    startup_s: float
    metrics: dict[str, Any] = field(default_factory=dict)


#: τ and speed of one (method, category, temperature[, span]): a row of results.json's `rows`,
#: `comparisons` and `span_rows`; one declaration, the record results.json's readers load
CategoryResult = EvalRow


@dataclass
class EvaluateResult:
    """The stage's result in memory (`run_evaluate`); results.json holds its fields but the three
    paths, plus how the run went. It stays beside the EvalResults record that results.json is read
    as: it carries this run's paths (out, results_path, chart_path), which results.json does not
    hold, and requires the headline fields that EvalResults leaves optional so that older files
    load; the Prefect layer and the CLI receive it as these fields (eagle3.stages.jsonable). Its
    rows are EvalRow records."""

    out: Path
    results_path: Path
    chart_path: Path | None
    num_prompts: int
    num_speculative_tokens: int
    #: τ, mean acceptance length (1 + accepted / drafts); at most k + 1 (first temperature, all
    #: categories)
    acceptance_length: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    #: accepted tokens at draft position 1..k
    accepted_per_position: list[int]
    #: accepted_per_position / num_drafts
    acceptance_rate_per_position: list[float]
    spec_tokens_per_s: float
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None
    #: fraction of prompts whose greedy output is identical with and without the draft
    outputs_match_baseline: float | None = None
    prompts_skipped: dict[str, int] = field(default_factory=dict)
    method: str = "eagle3"
    #: one per (category, temperature), "all" rows included
    rows: list[CategoryResult] = field(default_factory=list)
    #: see draft_cost()
    draft_cost: dict[str, Any] = field(default_factory=dict)
    #: method -> its predicted speed-up per k and concurrency (eagle3.evaluate.predict_for_method)
    predicted_speedup: dict[str, Any] = field(default_factory=dict)
    #: the rows of the methods of cfg.compare (same shape as `rows`, their own `method`), in
    #: cfg.compare's order
    comparisons: list[CategoryResult] = field(default_factory=list)
    #: thinking targets: the rows of every method (evaluated and compared) per span, reasoning
    #: and answer, per (category, temperature) with "all" rows (`span_plan`)
    span_rows: list[CategoryResult] = field(default_factory=list)


def _sum_calls(
    calls: list[dict[str, Any]], category: str = "all", span: str = "all"
) -> dict[str, Any]:
    """Calls as one (a temperature's categories, a category's spans): metrics summed, tokens
    concatenated, seconds added."""
    metrics: dict[str, Any] = {}
    for c in calls:
        for k, v in c["metrics"].items():
            if isinstance(v, list):
                prev = metrics.get(k, [])
                metrics[k] = [
                    (prev[i] if i < len(prev) else 0) + (v[i] if i < len(v) else 0)
                    for i in range(max(len(prev), len(v)))
                ]
            else:
                metrics[k] = metrics.get(k, 0) + v
    return {
        "temperature": calls[0]["temperature"],
        "category": category,
        "span": span,
        "seconds": sum(c["seconds"] for c in calls),
        "tokens": [t for c in calls for t in c["tokens"]],
        "finish_reasons": [r for c in calls for r in c["finish_reasons"]],
        "metrics": metrics,
    }


def _row(
    method: str, call: dict[str, Any], base: dict[str, Any] | None, cost: dict[str, Any]
) -> CategoryResult:
    m = call["metrics"]
    drafts, accepted = int(m.get(M_DRAFTS, 0)), int(m.get(M_ACCEPTED, 0))
    per_pos = [int(x) for x in m.get(M_PER_POS, [])]
    per_pos += [0] * (cost["k"] - len(per_pos))
    tau = round(1.0 + accepted / drafts, 4) if drafts else None
    gen = sum(len(t) for t in call["tokens"])
    tps = round(gen / call["seconds"], 1) if call["seconds"] > 0 else 0.0
    base_tps = match = None
    if base is not None:
        base_gen = sum(len(t) for t in base["tokens"])
        base_tps = round(base_gen / base["seconds"], 1) if base["seconds"] > 0 else None
        if call["temperature"] == 0 and len(call["tokens"]) == len(base["tokens"]):
            same = sum(a == b for a, b in zip(call["tokens"], base["tokens"], strict=True))
            match = round(same / len(call["tokens"]), 4)
    return CategoryResult(
        method=method,
        category=call["category"],
        temperature=call["temperature"],
        num_prompts=len(call["tokens"]),
        tau=tau,
        num_drafts=drafts,
        num_accepted_tokens=accepted,
        accepted_per_position=per_pos,
        generated_tokens=gen,
        tokens_per_s=tps,
        baseline_tokens_per_s=base_tps,
        measured_speedup=round(tps / base_tps, 3) if base_tps else None,
        tokens_per_step=tokens_per_target_step(gen, accepted),
        outputs_match_baseline=match,
        draft_cost_ratio=cost["flops_ratio"],
        span=call.get("span", "all"),
    )


def rows_of(
    method: str,
    job: dict[str, Any],
    base_job: dict[str, Any] | None,
    cost: dict[str, Any],
    temperatures: list[float],
    with_categories: bool,
) -> tuple[list[CategoryResult], dict[float, dict], list[CategoryResult]]:
    """Rows per (category, temperature) plus an "all" row per temperature; the "all" calls by
    temperature; and, for a thinking target's split calls, the same rows per span."""
    rows, totals, span_rows = [], {}, []

    def merged(job_: dict[str, Any] | None, t: float, cat: str, span: str) -> dict | None:
        if job_ is None:
            return None
        calls = [
            c
            for c in job_["calls"]
            if c["temperature"] == t
            and cat in ("all", c["category"])
            and span in ("all", c.get("span", "all"))
        ]
        return _sum_calls(calls, cat, span) if calls else None

    for t in temperatures:
        cats = list(dict.fromkeys(c["category"] for c in job["calls"] if c["temperature"] == t))
        spans = list(
            dict.fromkeys(c.get("span", "all") for c in job["calls"] if c["temperature"] == t)
        )
        totals[t] = {
            "spec": merged(job, t, "all", "all"),
            "base": merged(base_job, t, "all", "all"),
        }
        for cat in [*cats, "all"] if with_categories else ["all"]:
            rows.append(
                _row(method, merged(job, t, cat, "all"), merged(base_job, t, cat, "all"), cost)
            )
            for span in spans if spans != ["all"] else []:
                call = merged(job, t, cat, span)
                if call is not None:
                    span_rows.append(_row(method, call, merged(base_job, t, cat, span), cost))
    return rows, totals, span_rows


def run_summary(
    job: dict[str, Any] | None, call: dict[str, Any] | None, speculative: bool
) -> DecodeRun | None:
    """One engine's pass over every prompt at the first temperature (None without that engine)."""
    if job is None or call is None:
        return None
    gen = sum(len(t) for t in call["tokens"])
    return DecodeRun(
        speculative=speculative,
        num_prompts=len(call["tokens"]),
        generated_tokens=gen,
        seconds=round(call["seconds"], 3),
        tokens_per_s=round(gen / call["seconds"], 1),
        startup_s=round(job["startup_s"], 1),
        metrics=call["metrics"],
    )


@dataclass
class Measured:
    """An evaluation's figures from its engines' answers: the result (headline and rows), the
    speculative and plain runs it summarizes, and the "all" call of the first temperature."""

    result: EvaluateResult
    spec_run: DecodeRun
    base_run: DecodeRun | None
    head: dict[str, Any]
    #: τ and accepted / drafts per position, unrounded (the chart's)
    tau: float
    rates: list[float]


def measure(
    method: str,
    costs: dict[str, dict[str, Any]],
    jobs: tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]],
    temperatures: list[float],
    with_categories: bool,
    draft: Path | None,
    **result_fields: Any,
) -> Measured:
    """The rows of the evaluated method (cost `costs[method]`), of each compared method (its own
    cost) and per span, and the headline figures: the first temperature's "all" row.
    `result_fields`: EvaluateResult's fields that do not come from the counters (out, paths,
    num_prompts, num_speculative_tokens, prompts_skipped). RuntimeError when an eagle3 draft made
    no drafts."""
    spec, base, compared = jobs
    k = result_fields["num_speculative_tokens"]
    rows, totals, span_rows = rows_of(
        method, spec, base, costs[method], temperatures, with_categories
    )
    comparisons = []
    for m, job in compared.items():
        more = rows_of(m, job, base, costs[m], temperatures, with_categories)
        comparisons += more[0]
        span_rows += more[2]
    head = totals[temperatures[0]]["spec"]
    counters = head["metrics"]
    drafts = int(counters.get(M_DRAFTS, 0))
    if drafts == 0 and method == "eagle3":
        raise RuntimeError(
            f"vLLM reported no speculative drafts ({M_DRAFTS} = 0) for draft {draft}: the draft "
            "was not used; check the engine log above"
        )
    accepted = int(counters.get(M_ACCEPTED, 0))
    per_pos = [int(x) for x in counters.get(M_PER_POS, [])]
    per_pos += [0] * (k - len(per_pos))
    tau = 1.0 + accepted / drafts if drafts else 1.0
    rates = [c / drafts if drafts else 0.0 for c in per_pos]
    spec_run = run_summary(spec, head, True)
    base_run = run_summary(base, totals[temperatures[0]]["base"], False)
    head_row = next(r for r in rows if r.category == "all" and r.temperature == temperatures[0])
    result = EvaluateResult(
        **result_fields,
        acceptance_length=round(tau, 4),
        num_drafts=drafts,
        num_draft_tokens=int(counters.get(M_DRAFT_TOKENS, 0)),
        num_accepted_tokens=accepted,
        accepted_per_position=per_pos,
        acceptance_rate_per_position=[round(r, 4) for r in rates],
        spec_tokens_per_s=spec_run.tokens_per_s,
        baseline_tokens_per_s=base_run.tokens_per_s if base_run else None,
        speedup=round(spec_run.tokens_per_s / base_run.tokens_per_s, 3) if base_run else None,
        outputs_match_baseline=head_row.outputs_match_baseline,
        method=method,
        rows=rows,
        draft_cost=costs[method],
        comparisons=comparisons,
        span_rows=span_rows,
    )
    return Measured(result, spec_run, base_run, head, tau, rates)
