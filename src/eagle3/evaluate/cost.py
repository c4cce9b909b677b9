"""The draft's cost relative to the target (parameters, FLOPs of a speculation round), the weights
its steps read (eagle3.step_time.DraftWeights), and the speed-up per k and concurrency predicted
from the measured acceptance (eagle3.speedup; the model in eagle3.evaluate's docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.console import tokens_per_target_step as console_tokens_per_target_step
from eagle3.evaluate.checks import read_json_config
from eagle3.flops import count_target_params
from eagle3.speedup import predict_from_row
from eagle3.step_time import MeasuredRouting, draft_groups, draft_weights


def draft_cost(
    target: str | Path, draft: Path | None, k: int, method: str = "eagle3"
) -> dict[str, Any]:
    """The draft's cost relative to the target: parameter ratio, and the FLOPs of one speculation
    round (fc + k draft steps) over one target forward per token. What it costs in time on a
    machine is eagle3.speedup's (`predict_for_evaluation`)."""
    tcfg = read_json_config(Path(target) / "config.json")
    tc = tcfg.get("text_config") or tcfg
    tp = count_target_params(tc)
    H, V = int(tc["hidden_size"]), int(tc["vocab_size"])
    target_read = (
        tp["layers_active_per_token"] + V * H
    )  # decoder layers + lm_head (tied: the embedding matrix)
    if method == "ngram" or draft is None:
        return {
            "method": method,
            "k": k,
            "draft_params": 0,
            "target_params": tp["total"],
            "target_params_read_per_token": target_read,
            "param_ratio": 0.0,
            "flops_ratio": 0.0,
        }
    g, _ = draft_groups(draft)
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


def predict_for_method(
    target: str | Path,
    draft: Path | None,
    row: Any,
    context_len: float,
    hardware: str,
    routing: MeasuredRouting | None,
) -> dict[str, Any]:
    """eagle3.speedup.predict_from_row for one measured method: the target's config.json, the
    draft's own weights (None: n-gram), at the smallest tensor parallel size the weights fit."""
    tcfg = read_json_config(Path(target) / "config.json")
    weights = draft_weights(draft) if draft is not None else None
    return predict_from_row(tcfg, hardware, row, weights, context_len, routing).as_dict()
