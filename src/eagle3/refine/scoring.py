"""Scoring a draft on rollouts: its drafting rounds replayed as the offline estimator replays vLLM
(eagle3.train.onpolicy.find_rejected_blocks), the per-position acceptance α and τ per temperature
and pooled, the loss at the first rejected positions, and the choice of the best round."""

from __future__ import annotations

import math
from typing import Any

from eagle3.refine.plan import Plan
from eagle3.refine.runtime import Runtime
from eagle3.train.data import eval_batches
from eagle3.train.estimate import RoundCounts, score_batches
from eagle3.train.onpolicy import Replay, find_rejected_blocks, weighted_ce


def score(plan: Plan, ttt, samples, ids: list[str], rt: Runtime) -> dict[str, dict[str, Any]]:
    """The draft's replayed rounds on rollouts, per temperature (the sample id's prefix) and
    pooled ("all"): α at positions 1..k, τ and the number of rounds."""
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        groups.setdefault(sid.split("/", 1)[0], []).append(i)
    out, pooled = {}, RoundCounts(0, [0] * plan.k)
    for label, idx in sorted(groups.items()):
        batches = eval_batches(
            samples, idx, plan.train.loader.max_seq_len, plan.train.loader.batch_size
        )
        m = score_batches(
            ttt,
            batches,
            rt.head,
            steps=plan.k,
            device=rt.d.device,
            dtype=rt.amp,
            replay_k=plan.k,
            attention=plan.train.runtime.attention,
            accept_on="next_token",
        )
        counts = RoundCounts(int(m["num_rounds"]), [int(m[f"accepted_{j}"]) for j in range(plan.k)])
        pooled.add(counts)
        out[label] = figures(counts)
    out["all"] = figures(pooled)
    return out


def figures(counts) -> dict[str, Any]:
    """α at positions 1..k, τ and the number of rounds of replayed round counts."""
    return {
        "alpha": [round(a, 4) for a in counts.acceptance_per_position()],
        "tau": round(counts.tau, 4),
        "num_rounds": counts.num_rounds,
    }


def replay_figures(replay: Replay) -> dict[str, Any]:
    """A replay's figures and its number of rejected blocks (a round.json entry)."""
    return {**figures(replay.counts), "num_rejected_blocks": replay.num_rejected_blocks}


def _batching(plan: Plan, rt: Runtime) -> dict[str, Any]:
    return dict(
        max_seq_len=plan.train.loader.max_seq_len,
        batch_size=plan.train.loader.batch_size,
        device=rt.d.device,
        dtype=rt.amp,
        attention=plan.train.runtime.attention,
    )


def replay(plan: Plan, ttt, samples, rt: Runtime, **weights: float) -> Replay:
    """The draft's rounds (k tokens each) over `samples`: every round's start row and first
    rejected position (find_rejected_blocks; `weights`: its rejected_weight)."""
    steps = plan.train.loss.ttt_steps
    return find_rejected_blocks(
        ttt, samples, rt.head, k=plan.k, steps=steps, **weights, **_batching(plan, rt)
    )


def rejected_loss(plan: Plan, ttt, errors, rt: Runtime) -> float | None:
    """The TTT loss at the rows `errors` weighs (each round's first rejected step), rounded;
    None when it is not finite."""
    x = weighted_ce(ttt, errors, rt.head, steps=plan.train.loss.ttt_steps, **_batching(plan, rt))
    return round(x, 6) if math.isfinite(x) else None


def select_round(validations: list[dict[str, Any]]) -> int:
    """The round (0 = the input draft) of the highest pooled validation τ; ties: the earlier."""
    return max(range(len(validations)), key=lambda i: (validations[i]["all"]["tau"], -i))
