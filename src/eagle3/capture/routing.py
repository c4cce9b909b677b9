"""The target's routing, counted: how many distinct routed experts a verification pass wakes.

A verification pass of k+1 tokens per sequence over b sequences reads, in every MoE layer, the
weights of each distinct expert its (k+1)*b tokens route to. From the top-k expert ids of every
token of a few captured rows (ids [T, L, K] per row: T tokens, L MoE layers, K = top-k), this module
counts the distinct experts per layer for windows of t consecutive tokens of one row, taken from b
different rows at once (t = 1..8, b = 1, 4, 16, 64), and averages them: the figure
`eagle3.artifacts.RoutingStats` records (routing.json) and the verification-cost model reads.

Windows lie inside the loss-masked tokens (the target's answers: where a draft proposes tokens and
the target verifies them). Draws are bounded (`num_draws` per cell) and seeded; b = 1 takes every
window when there are no more than `num_draws`. A cell that lacks b rows with a window of t tokens
is None, with the reason.

Also here: the routers of the two MoE families, as reference implementations the tests hold both
backends to (DeepSeek-V3/Kimi: sigmoid scores plus the score-correction bias, the best
`topk_groups` of `num_groups` groups, then top-k; Qwen3-MoE: softmax top-k), and the uniform-routing
expectation for comparison. numpy and torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from eagle3.step_time import uniform_distinct_experts

#: the window lengths (tokens per sequence in one target pass) and sequence counts measured
WINDOW_TOKENS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
NUM_SEQUENCES: tuple[int, ...] = (1, 4, 16, 64)
#: model_types routed as DeepSeek-V3 (text configs of Kimi-K2/K2.5 are deepseek_v3)
GROUPED_BIAS_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2")
RoutingKind = Literal["grouped_topk_bias", "softmax_topk"]


@dataclass(frozen=True)
class RouterSpec:
    """How a target routes each token to `top_k` of its `num_experts` routed experts."""

    kind: RoutingKind
    num_experts: int
    top_k: int
    num_groups: int = 1  # grouped_topk_bias: expert groups (DeepSeek-V3: 8, Kimi-K2: 1)
    topk_groups: int = 1  # grouped_topk_bias: groups a token may route into


def router_spec(config: Mapping[str, Any]) -> RouterSpec | None:
    """The router of the target whose config.json is `config` (its `text_config` when nested); None
    for a target without routed experts. ValueError naming the model_type for an MoE router this
    module does not know."""
    text = config.get("text_config") or config
    model_type = str(text.get("model_type"))
    top_k = text.get("num_experts_per_tok")
    if text.get("n_routed_experts"):
        method = text.get("topk_method", "noaux_tc")
        if model_type not in GROUPED_BIAS_TYPES or method != "noaux_tc":
            raise ValueError(
                f"routing: model_type {model_type!r} (topk_method {method!r}) routes in a way "
                "the routing measurement does not know (it knows DeepSeek-V3/Kimi noaux_tc and "
                "Qwen3-MoE); set capture.routing_sample_rows: 0"
            )
        return RouterSpec(
            "grouped_topk_bias",
            int(text["n_routed_experts"]),
            int(top_k),
            int(text.get("n_group") or 1),
            int(text.get("topk_group") or 1),
        )
    # Qwen3-MoE's count of experts: `num_experts` (its checkpoints), `num_local_experts`
    # (transformers 5 writes that name)
    num_experts = text.get("num_experts") or text.get("num_local_experts")
    if model_type == "qwen3_moe" and num_experts:
        return RouterSpec("softmax_topk", int(num_experts), int(top_k))
    if top_k and num_experts:
        raise ValueError(
            f"routing: model_type {model_type!r} has routed experts but a router the routing "
            "measurement does not know (it knows DeepSeek-V3/Kimi and Qwen3-MoE); set "
            "capture.routing_sample_rows: 0"
        )
    return None


@dataclass
class RoutedRows:
    """What a backend's `route(samples)` returns: the MoE layers' decoder indices, each sample's
    expert ids [T, L, K] (int16, ascending layer order; the top-k in the router's order), and where
    the backend took them."""

    moe_layer_ids: list[int]
    ids: list[np.ndarray]
    source: str


# ------------------------------------------------------------------------------ reference routers
def grouped_topk_bias(logits: Any, bias: Any, spec: RouterSpec) -> Any:
    """DeepSeek-V3's (and Kimi's) expert choice, written from its definition: scores =
    sigmoid(logits) + bias; a group's score = the sum of its two best scores; the token keeps its
    `topk_groups` best groups and routes to the top_k best scores inside them. logits [N, E]
    (float32), bias [E] -> ids [N, K] int64 (sorted ascending: the set, not the order)."""
    import torch

    n, e = logits.shape
    scores = logits.float().sigmoid() + bias.float()  # [N, E]
    grouped = scores.view(n, spec.num_groups, e // spec.num_groups)  # [N, G, E/G]
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
    keep = group_scores.topk(spec.topk_groups, dim=-1).indices  # [N, Gk]
    allowed = torch.zeros(n, spec.num_groups, dtype=torch.bool)  # [N, G]
    allowed[torch.arange(n)[:, None], keep] = True
    masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view(n, e)  # [N, E]
    return masked.topk(spec.top_k, dim=-1).indices.sort(-1).values  # [N, K]


def softmax_topk(logits: Any, spec: RouterSpec) -> Any:
    """Qwen3-MoE's expert choice: the top_k of softmax(logits). [N, E] -> ids [N, K] int64
    (sorted ascending)."""
    return logits.float().softmax(-1).topk(spec.top_k, dim=-1).indices.sort(-1).values


def route_logits(logits: Any, spec: RouterSpec, bias: Any = None) -> Any:
    """The reference router of `spec` on router logits [N, E] (bias [E]: grouped_topk_bias's
    score-correction bias, zeros when None) -> ids [N, K] sorted ascending."""
    import torch

    if spec.kind == "softmax_topk":
        return softmax_topk(logits, spec)
    bias = torch.zeros(logits.shape[-1]) if bias is None else bias.detach().cpu()
    return grouped_topk_bias(logits.detach().cpu(), bias, spec)


def boundary_margin(logits: Any, spec: RouterSpec, bias: Any = None) -> Any:
    """Per token, the gap between the k-th and the (k+1)-th of the scores the router ranks (for
    grouped_topk_bias over all experts, a lower bound of its decisiveness): below ~1e-5, two
    implementations may rightly disagree on the experts. [N, E] -> [N] float32."""
    import torch

    if spec.kind == "softmax_topk":
        scores = logits.float().softmax(-1)
    else:
        b = torch.zeros(logits.shape[-1]) if bias is None else bias.detach().cpu().float()
        scores = logits.detach().cpu().float().sigmoid() + b
    top = scores.topk(spec.top_k + 1, dim=-1).values  # [N, K+1]
    return top[:, -2] - top[:, -1]


# ------------------------------------------------------------------------------------- the count
def window_starts(loss_mask: np.ndarray, t: int) -> np.ndarray:
    """Starts s of the windows [s, s+t) of a row that lie wholly in its loss-masked tokens.
    loss_mask [T] -> starts [W] int64."""
    m = np.asarray(loss_mask).astype(bool)
    if len(m) < t:
        return np.zeros(0, dtype=np.int64)
    run = np.convolve(m.astype(np.int64), np.ones(t, dtype=np.int64), mode="valid")  # [T-t+1]
    return np.flatnonzero(run == t)


@dataclass
class Draws:
    """The windows of one (t, b) cell: `tokens` [D, b*t] (rows of the concatenated ids), or None
    and `reason`."""

    tokens: np.ndarray | None
    reason: str | None = None


def draw_windows(
    offsets: np.ndarray,
    masks: Sequence[np.ndarray],
    t: int,
    b: int,
    num_draws: int,
    rng: np.random.Generator,
) -> Draws:
    """D draws of b windows of t tokens from b different rows. offsets [N+1]: row r's tokens are
    offsets[r]..offsets[r+1] of the concatenated ids; masks: each row's loss mask. b = 1: every
    window when there are at most `num_draws`, else `num_draws` drawn uniformly among all windows.
    b > 1: `num_draws` draws, each b rows without replacement, a uniform window in each."""
    starts = [window_starts(m, t) for m in masks]
    rows = [r for r, s in enumerate(starts) if len(s)]
    if len(rows) < b:
        return Draws(
            None,
            f"{len(rows)} of the {len(masks)} sampled rows have {t} consecutive answer tokens; "
            f"{b} sequences need {b} such rows (raise capture.routing_sample_rows)",
        )
    if b == 1:
        every = np.concatenate([offsets[r] + starts[r] for r in rows])  # [W]
        picked = every if len(every) <= num_draws else rng.choice(every, num_draws, replace=False)
        first = np.sort(picked)[:, None]  # [D, 1]
    else:
        first = np.empty((num_draws, b), dtype=np.int64)  # [D, b]
        for d in range(num_draws):
            chosen = rng.choice(rows, b, replace=False)
            first[d] = [offsets[r] + starts[r][rng.integers(len(starts[r]))] for r in chosen]
    tokens = (first[:, :, None] + np.arange(t)).reshape(len(first), b * t)  # [D, b*t]
    return Draws(tokens)


def count_distinct(ids: np.ndarray, tokens: np.ndarray, block_elems: int = 1 << 23) -> np.ndarray:
    """Distinct experts per draw and layer: ids [M, L, K] (the concatenated rows), tokens [D, n]
    -> counts [D, L] int64. Sorts each draw's n*K ids per layer and counts the changes, in blocks
    of draws of at most `block_elems` ids."""
    num_draws, n = tokens.shape
    _, num_layers, k = ids.shape
    out = np.empty((num_draws, num_layers), dtype=np.int64)
    step = max(1, block_elems // max(1, n * num_layers * k))
    for a in range(0, num_draws, step):
        got = ids[tokens[a : a + step]]  # [d, n, L, K]
        per_layer = np.sort(got.transpose(0, 2, 1, 3).reshape(len(got), num_layers, n * k), -1)
        out[a : a + step] = 1 + (np.diff(per_layer, axis=-1) != 0).sum(-1)  # [d, L]
    return out


@dataclass
class DistinctExperts:
    """The counts of every (t, b) cell: mean over layers and draws, per layer, draws per cell, and
    why a cell is None."""

    t: list[int]
    b: list[int]
    mean: list[list[float | None]]  # [t][b]
    per_layer_mean: dict[str, list[list[float | None]]]  # layer id -> [t][b]
    num_draws: list[list[int]]  # [t][b]
    null_reasons: dict[str, str]  # "t=8,b=64" -> why that cell is None


def distinct_experts(
    ids: np.ndarray,
    offsets: np.ndarray,
    masks: Sequence[np.ndarray],
    moe_layer_ids: Sequence[int],
    num_draws: int = 256,
    seed: int = 0,
    window_tokens: Sequence[int] = WINDOW_TOKENS,
    num_sequences: Sequence[int] = NUM_SEQUENCES,
) -> DistinctExperts:
    """Every (t, b) cell's distinct experts from the routed ids [M, L, K] of N rows (offsets [N+1],
    masks: each row's loss mask [T_r]), `num_draws` seeded draws per cell."""
    rng = np.random.default_rng(seed)
    shape = (len(window_tokens), len(num_sequences))
    mean: list[list[float | None]] = [[None] * shape[1] for _ in range(shape[0])]
    per_layer = {str(lid): [[None] * shape[1] for _ in range(shape[0])] for lid in moe_layer_ids}
    draws = [[0] * shape[1] for _ in range(shape[0])]
    reasons: dict[str, str] = {}
    for i, t in enumerate(window_tokens):
        for j, b in enumerate(num_sequences):
            drawn = draw_windows(offsets, masks, t, b, num_draws, rng)
            if drawn.tokens is None:
                reasons[f"t={t},b={b}"] = str(drawn.reason)
                continue
            counts = count_distinct(ids, drawn.tokens)  # [D, L]
            mean[i][j] = round(float(counts.mean()), 4)
            for lid, col in zip(moe_layer_ids, counts.T, strict=True):
                per_layer[str(lid)][i][j] = round(float(col.mean()), 4)
            draws[i][j] = int(len(drawn.tokens))
    return DistinctExperts(
        list(window_tokens), list(num_sequences), mean, per_layer, draws, reasons
    )


def uniform_table(
    spec: RouterSpec,
    window_tokens: Sequence[int] = WINDOW_TOKENS,
    num_sequences: Sequence[int] = NUM_SEQUENCES,
) -> list[list[float]]:
    """eagle3.step_time.uniform_distinct_experts for every (t, b) cell: the bound with no
    measurement."""
    return [
        [
            round(uniform_distinct_experts(spec.num_experts, spec.top_k, t * b), 4)
            for b in num_sequences
        ]
        for t in window_tokens
    ]
