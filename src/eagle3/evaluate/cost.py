"""The draft's cost relative to the target and the decode speed-up it buys on a memory-bound GPU
(the model in eagle3.evaluate's docstring)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3.console import tokens_per_target_step as console_tokens_per_target_step
from eagle3.evaluate.checks import read_json_config
from eagle3.flops import count_target_params


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
    tcfg = read_json_config(Path(target) / "config.json")
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
