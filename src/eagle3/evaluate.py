"""`eagle3 evaluate`: mean acceptance length τ of an EAGLE-3 draft in real vLLM, plus decode speed.

Protocol (refbench README): vLLM offline, `LLM(model=target, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k})`, the first
`num_prompts` prompts through the target's chat template with the generation prompt (prompts are the
turns before the first assistant turn of each row), greedy unless `temperature > 0`, `max_tokens`.

    τ = 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts

read from `llm.get_metrics()` (the engine is built with `disable_log_stats=False`), together with
`vllm:spec_decode_num_accepted_tokens_per_pos` (accepted count at draft position 1..k). A one-prompt
warm-up runs first; its counts are subtracted (metrics are snapshotted before and after the timed run).

With `baseline` the same prompts are decoded again without speculation under the same engine settings
for generated tokens/s with and without the draft (and the fraction of identical greedy outputs, a
sanity check of lossless verification; on CPU small numeric differences between batch shapes can flip
a few near-tie tokens). Each engine runs in its own spawned process, so two engines never coexist in
memory and their Prometheus counters never mix.

Writes `out/results.json` and `out/acceptance.png` (bar chart of per-position acceptance).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import EvaluateConfig
from eagle3.io import atomic_path, write_json

log = logging.getLogger(__name__)

RESULTS = "results.json"
CHART = "acceptance.png"

M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
M_GEN_TOKENS = "vllm:generation_tokens"
M_PROMPT_TOKENS = "vllm:prompt_tokens"


@dataclass
class DecodeRun:
    """One engine's timed pass over the prompts."""

    speculative: bool
    num_prompts: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    startup_s: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvaluateResult:
    out: Path
    results_path: Path
    chart_path: Path | None
    num_prompts: int
    num_speculative_tokens: int
    #: τ, mean acceptance length (1 + accepted / drafts); at most k + 1
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


def simulate_acceptance_length(per_step_acc: list[float]) -> float:
    """Offline τ estimate from per-step conditional acceptance rates.

    `per_step_acc[j]` = P(draft token j+1 accepted | tokens 1..j accepted) (e.g. the TTT step-j top-1
    accuracy in training). Expected tokens per verification step = 1 + sum_j prod_{i<=j} acc_i.
    Returns the sum part plus one, comparable with vLLM's τ.
    """
    total, prod = 1.0, 1.0
    for j, a in enumerate(per_step_acc):
        if not 0.0 <= a <= 1.0 or math.isnan(a):
            raise ValueError(f"per_step_acc[{j}] = {a} is not a probability in [0, 1]")
        prod *= a
        total += prod
    return total


# ------------------------------------------------------------------------------------ engine job
def _metrics_dict(metrics: list[Any]) -> dict[str, Any]:
    """Counters summed over labels (engines); the per-position vector summed element-wise."""
    out: dict[str, Any] = {}
    for m in metrics:
        if hasattr(m, "values") and isinstance(m.values, list):
            prev = out.get(m.name, [])
            vals = list(m.values)
            n = max(len(prev), len(vals))
            out[m.name] = [(prev[i] if i < len(prev) else 0) + (vals[i] if i < len(vals) else 0) for i in range(n)]
        elif type(m).__name__ == "Counter":
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or []
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(v)]
        else:
            out[k] = v - (b or 0)
    return out


def decode_job(llm_kwargs: dict[str, Any], prompts: list[list[int]], sampling: dict[str, Any]) -> dict[str, Any]:
    """Build one engine, warm it up, time greedy decoding of `prompts`; runs in a spawned process."""
    from eagle3.vllm_engine import setup_cpu_env, shutdown_engine

    setup_cpu_env()
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**llm_kwargs)
    startup = time.time() - t0
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(**{**sampling, "max_tokens": 8}), use_tqdm=False)
    before = _metrics_dict(llm.get_metrics())
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling), use_tqdm=False)
    seconds = time.time() - t1
    # the stats logger updates counters when outputs are processed; read them after generate returns
    after = _metrics_dict(llm.get_metrics())
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    shutdown_engine(llm)
    return {
        "startup_s": startup,
        "seconds": seconds,
        "tokens": tokens,
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "metrics": _diff(after, before),
        "loadavg_1m": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------------------ the stage
def _check_draft(draft: Path, k: int) -> dict[str, Any]:
    cfg_path = draft / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"--draft {draft}: no config.json there; pass the directory `eagle3 export` wrote")
    try:
        dcfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not any(draft.glob("*.safetensors")):
        raise FileNotFoundError(f"--draft {draft}: no *.safetensors weights; re-run `eagle3 export`")
    return dcfg


def _render_prompts(target: str, cfg: EvaluateConfig) -> tuple[list[list[int]], list[str], dict[str, int]]:
    from transformers import AutoTokenizer

    from eagle3.data.formats import read_prompts

    read = read_prompts(cfg.prompts, split=cfg.split)
    convs = read.conversations[: cfg.num_prompts]
    if len(convs) < cfg.num_prompts:
        log.warning("%s: only %d usable prompts (asked for %d)", cfg.prompts, len(convs), cfg.num_prompts)
    tok = AutoTokenizer.from_pretrained(target)
    if not tok.chat_template:
        raise ValueError(f"{target}: the tokenizer has no chat template; evaluate renders prompts with it")
    ids, names, skipped = [], [], dict(read.skipped)
    limit = cfg.max_model_len - cfg.max_tokens
    for c in convs:
        x = tok.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if hasattr(x, "keys"):
            x = x["input_ids"]
        x = list(x)
        if len(x) > limit:
            skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + 1
            continue
        ids.append(x)
        names.append(c.sample_id)
    if not ids:
        raise ValueError(f"{cfg.prompts}: no prompt fits max_model_len - max_tokens = {limit} tokens; raise --max-model-len")
    return ids, names, skipped


def _plot(path: Path, rates: list[float], counts: list[int], tau: float, k: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * k + 3, 3.6), dpi=110)
    xs = list(range(1, len(rates) + 1))
    bars = ax.bar(xs, rates, color="#3b75af")
    for b, r, c in zip(bars, rates, counts, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.01, f"{r:.2f}\n({c})", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.15)
    ax.set_title(f"{title}\nτ = {tau:.3f} (k = {k}, max {k + 1})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def run_evaluate(cfg: EvaluateConfig) -> EvaluateResult:
    """Measure τ (and tokens/s with and without the draft); see the module docstring."""
    from eagle3.vllm_engine import engine_kwargs, run_in_subprocess

    cfg.require("target", "draft", "prompts", "out")
    target, draft, out = str(cfg.target), Path(cfg.draft), Path(cfg.out)
    if not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: no config.json there")
    dcfg = _check_draft(draft, cfg.num_speculative_tokens)
    k = cfg.num_speculative_tokens
    prompts, names, skipped = _render_prompts(target, cfg)
    sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "seed": cfg.seed}
    common = dict(dtype=cfg.dtype, max_model_len=cfg.max_model_len, tensor_parallel_size=cfg.tensor_parallel_size, seed=cfg.seed)
    spec_kwargs = engine_kwargs(
        target,
        speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": k},
        disable_log_stats=False,
        **common,
    )
    log.info("evaluate: %d prompts, k=%d, draft %s", len(prompts), k, draft)
    spec = run_in_subprocess(decode_job, spec_kwargs, prompts, sampling)
    base = None
    if cfg.baseline:
        base_kwargs = engine_kwargs(target, disable_log_stats=False, **common)
        base = run_in_subprocess(decode_job, base_kwargs, prompts, sampling)

    m = spec["metrics"]
    drafts = int(m.get(M_DRAFTS, 0))
    accepted = int(m.get(M_ACCEPTED, 0))
    per_pos = [int(x) for x in m.get(M_PER_POS, [])]
    if len(per_pos) < k:
        per_pos += [0] * (k - len(per_pos))
    if drafts == 0:
        raise RuntimeError(
            f"vLLM reported no speculative drafts ({M_DRAFTS} = 0) for draft {draft}: the draft was not used; "
            "check the engine log above"
        )
    tau = 1.0 + accepted / drafts
    rates = [c / drafts for c in per_pos]

    def run_summary(r: dict[str, Any] | None, speculative: bool) -> DecodeRun | None:
        if r is None:
            return None
        gen = sum(len(t) for t in r["tokens"])
        return DecodeRun(
            speculative=speculative,
            num_prompts=len(r["tokens"]),
            generated_tokens=gen,
            seconds=round(r["seconds"], 3),
            tokens_per_s=round(gen / r["seconds"], 1),
            startup_s=round(r["startup_s"], 1),
            metrics=r["metrics"],
        )

    spec_run, base_run = run_summary(spec, True), run_summary(base, False)
    match = None
    if base is not None:
        match = sum(a == b for a, b in zip(spec["tokens"], base["tokens"], strict=True)) / len(prompts)
    result = EvaluateResult(
        out=out,
        results_path=out / RESULTS,
        chart_path=out / CHART,
        num_prompts=len(prompts),
        num_speculative_tokens=k,
        acceptance_length=round(tau, 4),
        num_drafts=drafts,
        num_draft_tokens=int(m.get(M_DRAFT_TOKENS, 0)),
        num_accepted_tokens=accepted,
        accepted_per_position=per_pos,
        acceptance_rate_per_position=[round(r, 4) for r in rates],
        spec_tokens_per_s=spec_run.tokens_per_s,
        baseline_tokens_per_s=base_run.tokens_per_s if base_run else None,
        speedup=round(spec_run.tokens_per_s / base_run.tokens_per_s, 3) if base_run else None,
        outputs_match_baseline=round(match, 4) if match is not None else None,
        prompts_skipped=skipped,
    )
    _plot(out / CHART, rates, per_pos, tau, k, f"{Path(target).name} + {draft.name}")
    import vllm

    payload = {
        **{k2: v for k2, v in asdict(result).items() if k2 not in ("out", "results_path", "chart_path")},
        "speculative_run": asdict(spec_run),
        "baseline_run": asdict(base_run) if base_run else None,
        "finish_reasons": {r: spec["finish_reasons"].count(r) for r in set(spec["finish_reasons"])},
        "config": cfg.model_dump(mode="json"),
        "engine": {k2: v for k2, v in spec_kwargs.items()},
        "draft_config": {x: dcfg.get(x) for x in ("architectures", "draft_vocab_size", "eagle_config", "num_hidden_layers")},
        "env": {x: v for x, v in os.environ.items() if x.startswith("VLLM_CPU")},
        "loadavg_1m": [spec.get("loadavg_1m"), base.get("loadavg_1m") if base else None],
        "vllm_version": vllm.__version__,
        "prompt_ids": names,
    }
    write_json(out / RESULTS, payload)
    return result
