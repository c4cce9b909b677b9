"""The evaluate stage as a sequence: check the inputs, render the prompts, run every engine in one
fresh process, rows from their counters, then results.json, results.md and the chart."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3.artifacts import DraftMetadata, EvalResults, RoutingStats
from eagle3.chat_template import ChatRenderer
from eagle3.config import ConfigError, EvaluateConfig
from eagle3.console import comparison_entries, format_comparison
from eagle3.evaluate.checks import check_chat_template, check_draft, check_draft_target
from eagle3.evaluate.cost import draft_cost, predict_for_method
from eagle3.evaluate.engine import (
    M_PROMPT_TOKENS,
    Engines,
    decode_jobs,
    plan_engines,
    sampled_rows_problem,
    span_plan,
)
from eagle3.evaluate.prompts import UNCATEGORIZED, group_by_category, render_prompts
from eagle3.evaluate.report import (
    CHART,
    RESULTS,
    SPEEDUP_CHART,
    format_rows,
    plot_acceptance,
    plot_speedup,
)
from eagle3.evaluate.rows import EvaluateResult, Measured, measure
from eagle3.hardware import hardware_profile
from eagle3.io import write_text
from eagle3.lock import dir_lock
from eagle3.step_time import MeasuredRouting
from eagle3.vllm_engine import run_in_subprocess

log = logging.getLogger("eagle3.evaluate")


def run_evaluate(cfg: EvaluateConfig) -> EvaluateResult:
    """Measure τ per category and temperature (and tokens/s with and without speculation); see the
    eagle3.evaluate docstring."""
    target, out, draft = _paths(cfg)
    check_speedup_hardware(cfg)
    draft_config = check_draft(draft, cfg.num_speculative_tokens) if draft is not None else {}
    target_id = check_draft_target(cfg, draft)
    renderer = ChatRenderer(
        target,
        trust_remote_code=cfg.trust_remote_code,
        chat_template_kwargs=cfg.chat_template_kwargs,
        stage="evaluate",
    )
    chat = check_chat_template(cfg, draft, renderer)
    prompts, names, categories, skipped = render_prompts(renderer, cfg)
    by_cat = group_by_category(prompts, categories)
    groups = [(c, [prompts[i] for i in idx]) for c, idx in by_cat]
    engines = plan_engines(cfg, target)
    jobs = run_engines(cfg, out, engines, groups, span_plan(renderer))
    sampled_problem = sampled_rows_problem(cfg, jobs[0], jobs[2])
    if sampled_problem:
        log.warning(
            "evaluate: the sampled rows (temperature > 0) are not reliable: %s", sampled_problem
        )
    k = cfg.num_speculative_tokens
    costs = {cfg.method: draft_cost(target, draft, k, cfg.method)}
    costs |= {m: draft_cost(target, None, k, m) for m in jobs[2]}
    measured = measure(
        cfg.method,
        costs,
        jobs,
        cfg.passes,
        with_categories=not (len(by_cat) == 1 and by_cat[0][0] == UNCATEGORIZED),
        draft=draft,
        out=out,
        results_path=out / RESULTS,
        chart_path=out / CHART,
        num_prompts=len(prompts),
        num_speculative_tokens=k,
        prompts_skipped=skipped,
    )
    label = (
        draft.name
        if draft is not None
        else f"ngram {cfg.prompt_lookup_min}-{cfg.prompt_lookup_max}"
    )
    rates, per_pos = measured.rates, measured.result.accepted_per_position
    plot_acceptance(out / CHART, rates, per_pos, measured.tau, k, f"{Path(target).name} + {label}")
    measured.result.predicted_speedup = predict(cfg, target, draft, measured)
    plot_speedup(out / SPEEDUP_CHART, measured.result.predicted_speedup, Path(target).name)
    record = run_record(cfg, engines, jobs, draft_config, target_id, sampled_problem, chat)
    record |= {
        "prompt_ids": [names[i] for _, idx in by_cat for i in idx],  # the "all" rows' order
        "prompt_categories": dict(Counter(categories)),
    }
    write_results(cfg, measured, record)
    return measured.result


def predict(
    cfg: EvaluateConfig, target: str, draft: Path | None, measured: Measured
) -> dict[str, Any]:
    """The predicted speed-up per k and concurrency of every measured method (the evaluated one
    and those of `compare`) on cfg.speedup_hardware, from its row over every prompt at the first
    temperature; mean context = mean prompt + half the mean answer."""
    head = measured.head
    n = max(len(head["tokens"]), 1)
    generated = sum(len(t) for t in head["tokens"])
    context = head["metrics"].get(M_PROMPT_TOKENS, 0) / n + generated / n / 2
    routing = measured_routing(cfg, draft)
    first = cfg.passes[0]
    rows = [
        r
        for r in measured.result.rows + measured.result.comparisons
        if r.category == "all" and r.temperature == first
    ]
    return {
        r.method: predict_for_method(
            target,
            draft if r.method == cfg.method else None,
            r,
            context,
            cfg.speedup_hardware,
            routing,
        )
        for r in rows
    }


def check_speedup_hardware(cfg: EvaluateConfig) -> None:
    """A GPU profile for the predicted speed-up, checked before any engine starts."""
    try:
        hw = hardware_profile(cfg.speedup_hardware)
    except ValueError as e:
        raise ConfigError(f"EvaluateConfig.speedup_hardware: {e}") from None
    if hw.bf16_tflops is None:
        raise ConfigError(
            f"EvaluateConfig.speedup_hardware = {cfg.speedup_hardware!r} has no GPU figures; "
            "name a GPU profile (h200, h100, b300, rtx-pro-6000, h200-device)"
        )


def measured_routing(cfg: EvaluateConfig, draft: Path | None) -> MeasuredRouting | None:
    """cfg.routing, else the routing.json beside the capture the draft was trained on (its
    eagle3_draft.json names it), else None (the uniform-routing bound)."""
    if cfg.routing:
        return MeasuredRouting.read(cfg.routing)
    meta_path = draft / DraftMetadata.FILE if draft is not None else None
    if meta_path is None or not meta_path.is_file():
        return None
    meta = DraftMetadata.read(meta_path)
    captured = Path(meta.captured) if getattr(meta, "captured", None) else None
    if captured is not None and (captured / RoutingStats.FILE).is_file():
        return MeasuredRouting.read(captured)
    return None


def _paths(cfg: EvaluateConfig) -> tuple[str, Path, Path | None]:
    """(target, out dir, draft dir or None for ngram), after checking the config names them and
    the target has a config.json."""
    cfg.require("target", "prompts", "out")
    if cfg.method == "eagle3":
        cfg.require("draft")
    target, out = str(cfg.target), Path(cfg.out)
    draft = Path(cfg.draft) if cfg.method == "eagle3" else None
    if not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: no config.json there")
    return target, out, draft


def run_engines(
    cfg: EvaluateConfig,
    out: Path,
    engines: Engines,
    groups: list[tuple[str, list[list[int]]]],
    spans: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """Every engine, one after the other, in one fresh process forked from a server that imported
    vLLM once (`decode_jobs`); the out dir's lock records that process and its engines (a later run
    names them if they outlive this one). Their answers as `Engines.split` gives them."""
    log.info(
        "evaluate: %s, %d prompts in %d categories, temperatures %s, k=%d",
        cfg.method,
        sum(len(p) for _, p in groups),
        len(groups),
        cfg.passes,
        cfg.num_speculative_tokens,
    )
    with dir_lock(out, "evaluate out"):
        done = run_in_subprocess(decode_jobs, engines.jobs, groups, engines.samplings, spans)
    return engines.split(done)


def run_record(
    cfg: EvaluateConfig,
    engines: Engines,
    jobs: tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]],
    draft_config: dict[str, Any],
    target_id: dict[str, Any],
    sampled_problem: str | None,
    chat: dict[str, Any],
) -> dict[str, Any]:
    """How the evaluation ran, for results.json: the config, the target measured, the engines'
    kwargs, start-up times and loads, the worker's sampling-fix answers (and why sampled rows
    cannot be trusted), the draft's config, the VLLM_CPU environment, vLLM's version and how the
    prompts were rendered."""
    import vllm

    spec, base, compared = jobs
    return {
        "config": cfg.model_dump(mode="json"),
        # the target measured: config.json and every weight file (eagle3.identity)
        "target_config_sha256": target_id["config_sha256"],
        "target_fingerprint": target_id["fingerprint"],
        "dtype": engines.speculative["dtype"],  # the one used (cfg.dtype may say auto)
        "engine": dict(engines.speculative),
        "engine_startup_s": {
            "speculative": round(spec["startup_s"], 1),
            "baseline": round(base["startup_s"], 1) if base else None,
            **{m: round(j["startup_s"], 1) for m, j in compared.items()},
        },
        # the engines of cfg.compare: their speculative_config and the worker's sampling-fix answer
        "comparison_engines": {
            m: {
                "speculative_config": engines.compared[m]["speculative_config"],
                "sampling_fix": j.get("sampling_fix"),
                "loadavg_1m": j.get("loadavg_1m"),
            }
            for m, j in compared.items()
        },
        "draft_config": {
            x: draft_config.get(x)
            for x in ("architectures", "draft_vocab_size", "eagle_config", "num_hidden_layers")
        },
        "env": {x: v for x, v in os.environ.items() if x.startswith("VLLM_CPU")},
        "loadavg_1m": [spec.get("loadavg_1m"), base.get("loadavg_1m") if base else None],
        "vllm_version": vllm.__version__,
        # the worker's answer to eagle3_fix_cpu_sampling (speculative engine, sampled passes only)
        # and, when the sampled rows cannot be trusted, why
        "sampling_fix": spec.get("sampling_fix"),
        "sampled_rows_unreliable": sampled_problem,
        "chat": chat,
        "unclosed_reasoning": {
            f"{m} T{c['temperature']:g}": c["unclosed"]
            for m, j in {cfg.method: spec, **compared}.items()
            for c in j["calls"]
            if "unclosed" in c
        },
    }


def write_results(cfg: EvaluateConfig, measured: Measured, record: dict[str, Any]) -> None:
    """results.json (the result's fields, the runs it summarizes, how they ran) and results.md;
    the side-by-side table in the log when methods were compared."""
    result, head = measured.result, measured.head
    payload = {
        **{
            k: v
            for k, v in asdict(result).items()
            if k not in ("out", "results_path", "chart_path")
        },
        "speculative_run": asdict(measured.spec_run),
        "baseline_run": asdict(measured.base_run) if measured.base_run else None,
        "finish_reasons": {r: head["finish_reasons"].count(r) for r in set(head["finish_reasons"])},
        **record,
    }
    results = EvalResults.from_dict(payload, str(result.out / RESULTS))
    results.save(result.out)
    write_text(result.out / "results.md", format_rows(result))
    if result.comparisons:
        log.info(
            "evaluate: %s and %s side by side\n%s",
            cfg.method,
            ", ".join(cfg.compare),
            format_comparison(comparison_entries(results)),
        )
