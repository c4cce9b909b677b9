"""The speed-up speculative decoding gives on a machine, from measured acceptance and the step-time
model (eagle3.step_time): per k (draft tokens per step) and concurrency (sequences decoding at
once), the tokens each sequence gains per target step, the step's time, and the speed-up over
decoding without speculation; the best k per concurrency, or "speculation does not pay here".

    acc = Acceptance.from_counts([512, 301, 170], num_drafts=800, num_decode_passes=820)
    pred = predict_speedups(target_config, "h200", tp=8, acceptance=acc, draft=None,
                            context_len=1500)
    print(pred.format_markdown())

Acceptance: vLLM's per-position counters (`spec_decode_num_accepted_tokens_per_pos`): r_j =
accepted at position j / drafts = P(the first j draft tokens all accepted | the step drafted). At
k the tokens a sequence gains per target step are 1 + f · Σ_{j≤k} r_j, f the fraction of decode
passes that drafted (an EAGLE draft drafts at every pass: f = 1; n-gram only where the context
repeats). Beyond the measured k, r_j = r_{j-1} · c with c the last measured conditional acceptance
r_k / r_{k-1} (r_1 when k = 1): stated in every output as `extrapolation`.

Step (b = concurrency, T = eagle3.step_time.predict_pass_time_s):

    no speculation   T(1, b)
    speculation      target: T(1 + f·k, b) for b > 1 (the drafting share of the batch's
                     sequences verify k + 1 tokens); f·T(k+1, 1) + (1 − f)·T(1, 1) for b = 1
                     + the draft's k steps and its fc (eagle3.step_time.predict_draft_time_s;
                     n-gram: none)
    speed-up         (1 + f·Σ_{j≤k} r_j) · T(1, b) / step

The recommended k per concurrency is the one with the largest speed-up, where that exceeds
PAYS_ABOVE (1.02); else "speculation does not pay here".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from eagle3.hardware import HardwareProfile, hardware_profile
from eagle3.step_time import (
    DraftWeights,
    MeasuredRouting,
    predict_draft_time_s,
    predict_pass_time_s,
    target_weight_bytes,
)

KS = (1, 2, 3, 4, 5, 6, 7)
CONCURRENCIES = (1, 4, 16, 64)
DOES_NOT_PAY = "speculation does not pay here"
#: the least predicted speed-up that counts as paying: gains under 2 % are inside what this model
#: resolves (its fixed time per pass alone is an estimate), so no k is recommended for them
PAYS_ABOVE = 1.02


@dataclass(frozen=True)
class Acceptance:
    """Measured acceptance: `rates[j]` = P(draft positions 1..j+1 all accepted | drafted), and the
    fraction of decode passes that drafted."""

    rates: list[float]
    drafted_fraction: float
    method: str = "eagle3"

    @classmethod
    def from_counts(
        cls,
        accepted_per_position: list[int],
        num_drafts: int,
        num_decode_passes: int,
        method: str = "eagle3",
    ) -> Acceptance:
        """From vLLM's counters: accepted per position, drafts, and the decode passes (generated
        tokens − accepted tokens − the prompts' first tokens, which prefill emits)."""
        if num_drafts <= 0 or not accepted_per_position:
            return cls([0.0] * max(len(accepted_per_position), 1), 0.0, method)
        f = min(num_drafts / num_decode_passes, 1.0) if num_decode_passes > 0 else 1.0
        return cls([a / num_drafts for a in accepted_per_position], f, method)

    @property
    def extrapolation(self) -> str:
        k = len(self.rates)
        c = self._conditional()
        return (
            f"measured to k = {k}; beyond it each position keeps the last measured conditional "
            f"acceptance ({c:.3f} = r{k}/r{k - 1})"
            if k > 1
            else f"measured to k = 1; beyond it each position accepts with r1 = {c:.3f}"
        )

    def _conditional(self) -> float:
        r = self.rates
        if len(r) == 1:
            return r[0]
        return r[-1] / r[-2] if r[-2] > 0 else 0.0

    def rate(self, j: int) -> float:
        """r_j for draft position j (1-based), extrapolated past the measured k."""
        if j <= len(self.rates):
            return self.rates[j - 1]
        return self.rates[-1] * self._conditional() ** (j - len(self.rates))

    def tokens_per_step(self, k: int) -> float:
        """Tokens a sequence gains per target pass when serving with k draft tokens."""
        return 1.0 + self.drafted_fraction * sum(self.rate(j) for j in range(1, k + 1))


@dataclass
class SpeedupRow:
    k: int
    concurrency: int
    tokens_per_step: float
    step_time_s: float
    target_pass_s: float
    draft_s: float
    baseline_step_time_s: float
    speedup: float


@dataclass
class SpeedupPrediction:
    """Predicted speed-ups on one machine (results.json's `predicted_speedup`)."""

    method: str
    hardware: str
    tensor_parallel_size: int
    context_len: float
    routing_source: str
    drafted_fraction: float
    measured_rates: list[float]
    extrapolation: str
    rows: list[SpeedupRow]
    #: concurrency -> the best k, None where no k pays
    recommended_k: dict[int, int | None]
    notes: list[str] = field(default_factory=list)

    def best(self, concurrency: int) -> SpeedupRow | None:
        k = self.recommended_k.get(concurrency)
        return next((r for r in self.rows if r.concurrency == concurrency and r.k == k), None)

    def as_dict(self) -> dict[str, Any]:
        """For results.json: the fields, with the one-line summary and the markdown table a
        reader shows as they are."""
        d = asdict(self)
        d["recommended_k"] = {str(c): k for c, k in self.recommended_k.items()}
        return d | {"summary": self.summary_line(), "table_markdown": self.format_markdown()}

    def summary_line(self) -> str:
        """One line: the best k and speed-up per concurrency, or that speculation does not pay."""
        parts = []
        for c, k in self.recommended_k.items():
            row = self.best(c)
            parts.append(f"{c}: k {k} ×{row.speedup:.2f}" if row else f"{c}: {DOES_NOT_PAY}")
        return (
            f"predicted speed-up on {self.hardware} TP {self.tensor_parallel_size} by concurrency "
            f"({'; '.join(parts)})"
        )

    def format_markdown(self) -> str:
        """The table per k and concurrency, the recommendation, and what the figures rest on."""
        cs = sorted(self.recommended_k)
        lines = [
            f"Predicted speed-up over no speculation, {self.method} on {self.hardware} at tensor "
            f"parallel {self.tensor_parallel_size}, mean context {self.context_len:,.0f} tokens "
            f"(eagle3.step_time; expert routing: {self.routing_source}; acceptance: "
            f"{self.extrapolation}; {self.drafted_fraction:.0%} of passes drafted):",
            "",
            "| k | " + " | ".join(f"concurrency {c}: tokens/step, step ms, speed-up" for c in cs)
            + " |",
            "|---:|" + "---|" * len(cs),
        ]  # fmt: skip
        for k in sorted({r.k for r in self.rows}):
            cells = []
            for c in cs:
                r = next(x for x in self.rows if x.k == k and x.concurrency == c)
                cells.append(
                    f"{r.tokens_per_step:.2f}, {r.step_time_s * 1e3:.2f}, ×{r.speedup:.2f}"
                )
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
        for c in cs:
            row = self.best(c)
            lines.append(
                f"- concurrency {c}: "
                + (
                    f"recommended k = {row.k} (×{row.speedup:.2f}; no speculation "
                    f"{row.baseline_step_time_s * 1e3:.2f} ms per step)"
                    if row
                    else f"{DOES_NOT_PAY} (no k from 1 to {max(r.k for r in self.rows)} is "
                    f"more than {PAYS_ABOVE - 1:.0%} faster than decoding without speculation)"
                )
            )
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def predict_speedups(
    target_config: dict[str, Any],
    hardware: str | HardwareProfile,
    tp: int,
    acceptance: Acceptance,
    draft: DraftWeights | None,
    context_len: float,
    routing: MeasuredRouting | None = None,
    ks: tuple[int, ...] = KS,
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    weight_bits: int | None = None,
) -> SpeedupPrediction:
    """The model of the module docstring for every (k, concurrency); `draft` None: a proposer that
    reads no weights (n-gram)."""
    hw = hardware_profile(hardware)

    def target(t: float, b: int) -> float:
        return predict_pass_time_s(
            target_config, hw, tp, t, b, context_len, routing, weight_bits=weight_bits
        ).total_s

    f = acceptance.drafted_fraction
    rows, best = [], {}
    for c in concurrencies:
        base = target(1, c)
        for k in ks:
            if c == 1:
                t_pass = f * target(k + 1, 1) + (1 - f) * base
            else:
                t_pass = target(1 + f * k, c)
            d = predict_draft_time_s(draft, hw, tp, k, c, context_len) if draft else 0.0
            tokens = acceptance.tokens_per_step(k)
            step = t_pass + d
            rows.append(SpeedupRow(k, c, tokens, step, t_pass, d, base, tokens * base / step))
        top = max((r for r in rows if r.concurrency == c), key=lambda r: r.speedup)
        best[c] = top.k if top.speedup > PAYS_ABOVE else None
    probe = predict_pass_time_s(target_config, hw, tp, 1, 1, context_len, routing,
                                weight_bits=weight_bits)  # fmt: skip
    notes = [] if draft else ["the proposer reads no weights (n-gram): no draft cost"]
    return SpeedupPrediction(
        method=acceptance.method,
        hardware=hw.name,
        tensor_parallel_size=tp,
        context_len=context_len,
        routing_source=probe.routing_source,
        drafted_fraction=f,
        measured_rates=list(acceptance.rates),
        extrapolation=acceptance.extrapolation,
        rows=rows,
        recommended_k=best,
        notes=notes,
    )


def geometric_rates(
    k: int, *, mean_rate: float | None = None, tau: float | None = None
) -> list[float]:
    """Per-position rates r_j = c^j (one conditional acceptance c at every position) matching
    either vLLM's draft acceptance rate (`mean_rate` = accepted / draft tokens = Σ r_j / k) or a
    mean acceptance length (`tau` = 1 + Σ r_j) at k: how a single published figure becomes
    per-position acceptance."""
    target = mean_rate * k if mean_rate is not None else (tau or 1.0) - 1.0
    if not 0 <= target <= k:
        raise ValueError(f"acceptance {mean_rate=} {tau=} is outside what k={k} allows")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection on c: Σ c^j grows with c
        c = (lo + hi) / 2
        lo, hi = (c, hi) if sum(c**j for j in range(1, k + 1)) < target else (lo, c)
    c = (lo + hi) / 2
    return [c**j for j in range(1, k + 1)]


def break_even_tau(
    target_config: dict[str, Any],
    hardware: str | HardwareProfile,
    tp: int,
    k: int,
    concurrency: int,
    draft: DraftWeights | None,
    context_len: float,
    routing: MeasuredRouting | None = None,
) -> float | None:
    """The mean acceptance length τ at k (geometric per-position rates, every step drafting) at
    which speculation's predicted speed-up is exactly 1: below it speculation is slower; None when
    even every draft token accepted (τ = k + 1) is not faster."""

    def speedup(tau: float) -> float:
        acc = Acceptance(geometric_rates(k, tau=tau), 1.0)
        p = predict_speedups(target_config, hardware, tp, acc, draft, context_len, routing,
                             ks=(k,), concurrencies=(concurrency,))  # fmt: skip
        return p.rows[0].speedup

    if speedup(k + 1.0) <= 1.0:
        return None
    lo, hi = 1.0, k + 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) < 1.0 else (lo, mid)
    return (lo + hi) / 2


def serving_tensor_parallel_size(
    target_config: dict[str, Any], hardware: str | HardwareProfile, weight_bits: int | None = None
) -> int:
    """The smallest power-of-two tensor parallel size (at most the profile's GPUs) at which the
    target's weights take at most 90 % of each GPU's memory; all the GPUs when none does."""
    hw = hardware_profile(hardware)
    total = target_weight_bytes(target_config, weight_bits)
    tp = 1
    while tp < hw.num_gpus and total / tp > 0.9 * hw.memory_gb * 1e9:
        tp *= 2
    return min(tp, hw.num_gpus)


def predict_from_row(
    target_config: dict[str, Any],
    hardware: str | HardwareProfile,
    row: Any,
    draft: DraftWeights | None,
    context_len: float,
    routing: MeasuredRouting | None = None,
    tp: int | None = None,
    weight_bits: int | None = None,
) -> SpeedupPrediction:
    """predict_speedups for one measured method of an evaluation: `row` its EvalRow over every
    prompt (accepted per position, drafts; decode passes = generated − accepted − the prompts'
    first tokens), `tp` default the smallest tensor parallel size the target's weights fit."""
    passes = int(row.generated_tokens) - int(row.num_accepted_tokens) - int(row.num_prompts)
    acc = Acceptance.from_counts(
        list(row.accepted_per_position or []), int(row.num_drafts or 0), passes, str(row.method)
    )
    tp = tp or serving_tensor_parallel_size(target_config, hardware, weight_bits)
    return predict_speedups(
        target_config, hardware, tp, acc, draft, context_len, routing, weight_bits=weight_bits
    )
