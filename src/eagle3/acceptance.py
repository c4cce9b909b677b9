"""Acceptance arithmetic below the stages: the offline τ that training's estimate
(eagle3.train.estimate) computes from per-step acceptance rates, comparable with the τ vLLM
reports (eagle3.evaluate)."""

from __future__ import annotations

import math


def simulate_acceptance_length(per_step_acc: list[float]) -> float:
    """Offline τ estimate from per-step conditional acceptance rates.

    `per_step_acc[j]` = P(draft token j+1 accepted | tokens 1..j accepted) (e.g. the TTT step-j
    top-1 accuracy in training). Expected tokens per verification step = 1 + sum_j prod_{i<=j}
    acc_i. Returns the sum part plus one, comparable with vLLM's τ.
    """
    total, prod = 1.0, 1.0
    for j, a in enumerate(per_step_acc):
        if not 0.0 <= a <= 1.0 or math.isnan(a):
            raise ValueError(f"per_step_acc[{j}] = {a} is not a probability in [0, 1]")
        prod *= a
        total += prod
    return total
