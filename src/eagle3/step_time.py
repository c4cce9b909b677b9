"""The time of one target forward pass in decode: t query tokens per sequence over b sequences,
tensor parallel over `tp` GPUs of a hardware profile (eagle3.hardware). One model for every
estimate that prices a decode step: `eagle3 plan`'s regenerate rate (t = 1, a large batch),
a verification pass of speculative decoding (t = k + 1) and a no-speculation step (t = 1), and
the draft's own steps (eagle3.speedup).

    pass = predict_pass_time_s(target_config, "rtx-pro-6000", tp=8, t=4, b=1, context_len=2000)
    pass.total_s, pass.as_dict()

Per pass, per GPU (n = t·b tokens):

    weights   = Σ_parts bytes_per_param(part) · params(part) / tp          (sharded parts)
              + bytes_per_param · params                                   (replicated parts: the
                routers and MLA's q_a / kv_a projections, which vLLM keeps whole on every rank)
      routed experts: Σ_MoE layers E[distinct experts among the n routed tokens] · expert params;
      shared experts, attention, dense MLPs, lm_head: once (a weight is read once per pass, however
      many tokens multiply it); the embedding: n rows.
    kv        = b · (context_len + t) · kv bytes per token (every layer); MLA's latent cache is
                replicated on every rank, grouped-query KV is split over min(tp, kv heads)
    memory_s  = (weights + kv) / (memory_tb_s · ACHIEVED_MEMORY_SHARE)
    flops     = 2 · n · (active parameters per token) + attention over the context
                (MLA absorbed, as vLLM decodes: nh·(2·kv_lora_rank + rope) multiply-adds per key)
    compute_s = flops per GPU / (bf16_tflops · ACHIEVED_MATMUL_SHARE)
    comm_s    = (2·layers + 1) all-reduces of n·hidden bf16 values (attention output, MoE/MLP
                output, the vocab-parallel embedding), ring: latency + 2(tp-1)/tp · bytes /
                interconnect_gb_s each; + one gather of the n·vocab logits: latency +
                (tp-1)/tp · bytes / interconnect_gb_s
    total_s   = max(memory_s, compute_s) + comm_s + PASS_OVERHEAD_S

E[distinct experts]: measured routing (MeasuredRouting, from capture's routing.json, interpolated as
`MeasuredRouting.distinct_experts` says) or, without one, the uniform-routing bound
E·(1 − (1 − top_k/E)^n) — every token's top-k a uniform draw, tokens independent — which
over-counts: routing is heavy-tailed and consecutive tokens share experts (MoE-Spec, arXiv
2602.16052). The breakdown says which (`routing_source`).

Bytes per parameter come from the target config's own `quantization_config` (`weight_bytes`):
compressed-tensors (e.g. Kimi-K2.5: INT4 W4A16 routed experts, symmetric, groups of 32 with a
bf16 scale each: 0.5 + 2/32 = 0.5625 B; attention, shared experts, dense MLPs and lm_head ignored,
so bf16) and block fp8 (DeepSeek-V3: 1 B + a float32 scale per 128x128 block); without one, the
config's torch_dtype (2 B for bf16).

Sources of the constants: ACHIEVED_MEMORY_SHARE and ACHIEVED_MATMUL_SHARE and every profile
figure: eagle3.hardware. PASS_OVERHEAD_S below. Left out: the sampler and rejection sampler,
activations' own memory traffic, the n-gram proposer's search on the host (vllm-project/vllm#22408:
0.9 % of the critical path for a 17B-active model, 5-8 % for 125M), the overlap of communication
with compute (none in decode: each all-reduce waits on the layer before it).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.artifacts import RoutingStats
from eagle3.flops import count_draft_params, count_target_param_groups, kv_cache_bytes_per_token
from eagle3.hardware import (
    ACHIEVED_MATMUL_SHARE,
    ACHIEVED_MEMORY_SHARE,
    HardwareProfile,
    hardware_profile,
)
from eagle3.io import read_json

#: Fixed time per target pass that no term above counts: kernel launch gaps inside the CUDA
#: graph, scheduling and input preparation not hidden behind the GPU, the sampled tokens' trip to
#: the host. Derived, not fitted to any speculative-decoding figure: vllm-project/vllm#48229
#: reports ~6 ms per decode step for Qwen2.5-7B-Instruct at batch 32 on one H100 (vLLM 0.24, V1,
#: CUDA graphs); this model's memory time for that step is 4.85 ms (14.15 GB of weights + ~0.28
#: GB of KV at 3.35 TB/s x ACHIEVED_MEMORY_SHARE), which leaves ~1.2 ms. The GPU check of measured
#: pass times calibrates it.
PASS_OVERHEAD_S = 1.2e-3

#: bytes of one activation / logit value crossing the interconnect (bf16)
ACTIVATION_BYTES = 2

ROUTING_SCHEMA = RoutingStats.SCHEMA
ROUTING_FILE = RoutingStats.FILE
UNIFORM_ROUTING = "uniform routing (not measured)"

# ------------------------------------------------------------------------------- bytes per weight

#: the parts of a target a pass reads, with a module name of each (DeepSeek-V3 / Kimi / Qwen3-MoE
#: naming) that a quantization_config's targets and ignore patterns are matched against
_PART_MODULES: dict[str, tuple[str, ...]] = {
    "attention": ("model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.q_proj"),
    "dense_mlp": ("model.layers.0.mlp.gate_proj",),
    "shared_experts": (
        "model.layers.1.mlp.shared_experts.gate_proj",
        "model.layers.1.mlp.shared_expert.gate_proj",
    ),
    "routed_experts": ("model.layers.1.mlp.experts.0.gate_proj",),
    "lm_head": ("lm_head",),
}
#: dtype name -> bytes
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def _dtype_bytes(tc: dict, target_config: dict) -> int:
    name = str(
        tc.get("torch_dtype") or tc.get("dtype") or target_config.get("torch_dtype") or "bfloat16"
    )
    return _DTYPE_BYTES.get(name.replace("torch.", ""), 2)


def _pattern_matches(pattern: str, module: str) -> bool:
    """compressed-tensors' rule: `re:<regex>` matches from the start of the module name, anything
    else is a module name (or a class name: "Linear" targets every linear layer)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == "Linear" or module == pattern or module.endswith("." + pattern)


def _group_bytes(weights: dict, hidden_size: int) -> float:
    """Bytes per parameter of one compressed-tensors weight scheme: the packed values + the scales
    (one per group / output channel / block, in bf16; 1 byte for mxfp formats) + a zero point per
    scale when asymmetric."""
    bits = float(weights.get("num_bits") or 16)
    strategy = str(weights.get("strategy") or "group")
    scale_b = 1.0 if str(weights.get("type")) == "float" and bits == 4 else 2.0
    if strategy == "group":
        per_scale = float(weights.get("group_size") or 128)
    elif strategy == "channel":
        per_scale = float(hidden_size)
    elif strategy == "block":
        bs = weights.get("block_structure") or [128, 128]
        per_scale = float(bs[0]) * float(bs[1])
    else:  # tensor
        per_scale = math.inf
    zero = 0.0 if weights.get("symmetric", True) else bits / 8
    return bits / 8 + (scale_b + zero) / per_scale


def weight_bytes(target_config: dict, weight_bits: int | None = None) -> dict[str, Any]:
    """Bytes per parameter of each part a pass reads (`_PART_MODULES`, plus the router, which
    stays in the model's dtype) and where the figures come from. `weight_bits`: every part but the
    router at that many bits (a checkpoint whose config has no quantization_config)."""
    tc = target_config.get("text_config") or target_config
    q = tc.get("quantization_config") or target_config.get("quantization_config") or {}
    dense = float(_dtype_bytes(tc, target_config))
    out: dict[str, Any] = {p: dense for p in _PART_MODULES} | {"router": dense}
    if weight_bits is not None and not q:
        out |= {p: weight_bits / 8 for p in _PART_MODULES}
        out["source"] = f"{weight_bits} bits per weight (given), router {dense:g} B"
        return out
    method = str(q.get("quant_method") or "")
    if method == "compressed-tensors":
        ignore = list(q.get("ignore") or [])
        for part, modules in _PART_MODULES.items():
            names = [m for mod in modules for m in (mod, "language_model." + mod)]
            if any(_pattern_matches(p, n) for p in ignore for n in names):
                continue
            for group in (q.get("config_groups") or {}).values():
                targets = group.get("targets") or []
                if group.get("weights") and any(
                    _pattern_matches(p, n) for p in targets for n in names
                ):
                    out[part] = _group_bytes(group["weights"], int(tc["hidden_size"]))
                    break
        out["source"] = "quantization_config (compressed-tensors)"
    elif method == "fp8":
        bs = q.get("weight_block_size") or [128, 128]
        skip = list(q.get("modules_to_not_convert") or q.get("ignored_layers") or []) + ["lm_head"]
        for part, modules in _PART_MODULES.items():
            if not any(s in m for s in skip for m in modules):
                out[part] = 1.0 + 4.0 / (float(bs[0]) * float(bs[1]))
        out["source"] = "quantization_config (block fp8, float32 scales)"
    elif q:
        raise ValueError(
            f"quantization_config.quant_method = {method!r} is not priced by eagle3.step_time "
            "(compressed-tensors and fp8 are); pass weight_bits= for its bits per weight"
        )
    else:
        out["source"] = f"no quantization_config: {dense:g} B per weight (torch_dtype)"
    return out


def target_weight_bytes(target_config: dict[str, Any], weight_bits: int | None = None) -> float:
    """Bytes of all the target's weights at their own precision (what a GPU must hold)."""
    tc = target_config.get("text_config") or target_config
    g = count_target_param_groups(tc)
    b = weight_bytes(target_config, weight_bits)
    return (
        g["attention"] * b["attention"]
        + g["dense_mlp"] * b["dense_mlp"]
        + g["router"] * b["router"]
        + g["shared_experts"] * b["shared_experts"]
        + g["routed_experts"] * b["routed_experts"]
        + (g["lm_head"] + g["embedding"]) * b["lm_head"]
    )


# ------------------------------------------------------------------------------ distinct experts


def uniform_distinct_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """E[distinct experts] among `num_tokens` tokens when each picks `top_k` of `num_experts`
    uniformly and independently: E·(1 − (1 − top_k/E)^n) (exact for that routing; an upper bound
    of what correlated, heavy-tailed routing wakes)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _effective_tokens(distinct: float, num_experts: int, top_k: int) -> float:
    """The n for which the uniform bound gives `distinct` (inverse of uniform_distinct_experts)."""
    d = min(distinct, num_experts * (1 - 1e-12))
    return math.log(1 - d / num_experts) / math.log(1 - top_k / num_experts)


def _interp(xs: list[float], x: float) -> tuple[int, int, float]:
    """(i, j, w): x between xs[i] and xs[j] at weight w of xs[j] (clamped to the ends)."""
    if x <= xs[0] or len(xs) == 1:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    j = next(i for i, v in enumerate(xs) if v >= x)
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])


@dataclass(frozen=True)
class MeasuredRouting:
    """The target's measured routing as the model reads it: capture's routing.json
    (eagle3.artifacts.RoutingStats, schema ROUTING_SCHEMA), the mean over MoE layers and draws of
    the number of distinct routed experts among t consecutive tokens of each of b sequences (b
    sequences from different rows); `mean[i][j]` at t[i], b[j], None where the sample had too few
    rows for that cell."""

    num_experts: int
    top_k: int
    t: list[int]
    b: list[int]
    mean: list[list[float | None]]
    num_rows: int = 0
    num_tokens: int = 0
    source: str = ""

    @classmethod
    def read(cls, path: str | Path) -> MeasuredRouting:
        """routing.json at `path` (the file, or the capture dir holding it)."""
        p = Path(path)
        record = RoutingStats.load(p)
        if record is None:
            raise ValueError(
                f"{p}: no {RoutingStats.FILE} there; capture measures it for MoE targets "
                "(capture.routing_sample_rows > 0)"
            )
        return cls.from_dict(record.to_dict(), record.origin or str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = ROUTING_FILE) -> MeasuredRouting:
        """Validate the table and build; errors name `source`, the field, the bad value and the
        fix."""

        def bad(fld: str, why: str) -> ValueError:
            return ValueError(
                f"{source}: {fld}: {why} (schema {ROUTING_SCHEMA}; {RoutingStats.FIX})"
            )

        if data.get("schema") != ROUTING_SCHEMA:
            raise bad("schema", f"{data.get('schema')!r}, expected {ROUTING_SCHEMA!r}")
        try:
            num_experts, top_k = int(data["num_experts"]), int(data["top_k"])
            d = data["distinct_experts"]
            ts, bs, mean = [int(x) for x in d["t"]], [int(x) for x in d["b"]], d["mean"]
        except (KeyError, TypeError, ValueError) as e:
            raise bad("a required field", f"missing or not a number: {e}") from None
        if not 0 < top_k <= num_experts:
            raise bad("top_k", f"{top_k} with num_experts {num_experts}")
        for name, xs in (("t", ts), ("b", bs)):
            if not xs or xs[0] < 1 or any(y <= x for x, y in zip(xs, xs[1:], strict=False)):
                raise bad(f"distinct_experts.{name}", f"{xs}: positive and increasing")
        if len(mean) != len(ts) or any(len(r) != len(bs) for r in mean):
            raise bad("distinct_experts.mean", f"not {len(ts)} rows (t) of {len(bs)} (b)")
        for i, row in enumerate(mean):
            for j, v in enumerate(row):
                hi = min(num_experts, top_k * ts[i] * bs[j])
                if v is not None and not top_k - 1e-6 <= float(v) <= hi + 1e-6:
                    raise bad(
                        f"distinct_experts.mean[{i}][{j}]",
                        f"{v} at t={ts[i]}, b={bs[j]}: outside [{top_k}, {hi}]",
                    )
        if all(v is None for r in mean for v in r):
            raise bad("distinct_experts.mean", "no cell measured")
        return cls(
            num_experts, top_k, ts, bs,
            [[None if v is None else float(v) for v in r] for r in mean],
            int(data.get("num_rows") or 0), int(data.get("num_tokens") or 0), source,
        )  # fmt: skip

    def _ratio(self, i: int, j: int) -> float:
        """n_eff / (t·b) of cell (i, j); an unmeasured cell takes the nearest measured one's (in
        log t + log b)."""
        if self.mean[i][j] is None:
            i, j = min(
                ((a, c) for a, r in enumerate(self.mean) for c, v in enumerate(r) if v is not None),
                key=lambda ac: (
                    abs(math.log(self.t[ac[0]] / self.t[i]))
                    + abs(math.log(self.b[ac[1]] / self.b[j]))
                ),
            )
        n_eff = _effective_tokens(float(self.mean[i][j]), self.num_experts, self.top_k)
        return n_eff / (self.t[i] * self.b[j])

    def distinct_experts(self, t: float, b: float) -> float:
        """E[distinct experts per MoE layer] among t tokens of each of b sequences. Each table
        entry is turned into the number of independent uniformly-routed tokens that would wake as
        many experts (n_eff, inverting the uniform bound) and its ratio to t·b; that ratio is
        interpolated linearly in (log t, log b) between table points and held at the table's edge
        beyond it (an extrapolation: a longer window or more sequences keep the measured
        correlation of the nearest point); the result is the uniform bound at n_eff = ratio·t·b,
        so it never exceeds num_experts."""
        if t * b <= 0:
            return 0.0
        lt, lb = [math.log(x) for x in self.t], [math.log(x) for x in self.b]
        i0, i1, wi = _interp(lt, math.log(t))
        j0, j1, wj = _interp(lb, math.log(b))
        r = (1 - wi) * ((1 - wj) * self._ratio(i0, j0) + wj * self._ratio(i0, j1)) + wi * (
            (1 - wj) * self._ratio(i1, j0) + wj * self._ratio(i1, j1)
        )
        return uniform_distinct_experts(self.num_experts, self.top_k, r * t * b)


# ------------------------------------------------------------------------------------- the pass


@dataclass
class PassTime:
    """One pass's time and where it goes (seconds; bytes and FLOPs per GPU)."""

    t: float
    b: int
    tp: int
    context_len: float
    hardware: str
    routing_source: str
    distinct_experts_per_layer: float
    weight_bytes: dict[str, float]
    kv_bytes: float
    flops: float
    memory_s: float
    compute_s: float
    allreduce_latency_s: float
    allreduce_bandwidth_s: float
    comm_s: float
    overhead_s: float
    total_s: float
    bound: str
    bytes_per_param: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attention_parts(tc: dict) -> tuple[int, int, int]:
    """(sharded projection params per layer, replicated ones, attention multiply-adds per query
    token per key in decode). MLA: q_a / kv_a projections replicated, absorbed attention over the
    latent cache; grouped-query attention: all sharded."""
    H, nh = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    if tc.get("kv_lora_rank"):
        nope, rope, v = (int(tc[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        qr, kvr = tc.get("q_lora_rank"), int(tc["kv_lora_rank"])
        replicated = (H * int(qr) if qr else 0) + H * (kvr + rope)
        sharded = (int(qr) if qr else H) * nh * (nope + rope) + kvr * nh * (nope + v) + nh * v * H
        return sharded, replicated, nh * (2 * kvr + rope)
    d = int(tc.get("head_dim") or H // nh)
    kvh = int(tc.get("num_key_value_heads") or nh)
    return H * d * (nh + 2 * kvh) + nh * d * H, 0, 2 * nh * d


def kv_bytes_per_token_per_gpu(tc: dict, tp: int, dtype_bytes: int = 2) -> float:
    """KV-cache bytes one token of context holds on each of `tp` GPUs: MLA's latent cache is
    replicated on every rank (it has no heads to split), grouped-query KV is split over
    min(tp, kv heads)."""
    split = 1 if tc.get("kv_lora_rank") else min(tp, int(tc.get("num_key_value_heads") or 1))
    return kv_cache_bytes_per_token(tc, dtype_bytes) / split


def comm_time_s(
    hw: HardwareProfile, tp: int, num_allreduces: int, allreduce_bytes: float, gather_bytes: float
) -> tuple[float, float]:
    """(latency part, bandwidth part) of `num_allreduces` ring all-reduces of `allreduce_bytes`
    each and one gather of `gather_bytes` over `tp` GPUs; (0, 0) at tp 1."""
    if tp <= 1:
        return 0.0, 0.0
    if not hw.interconnect_gb_s or hw.allreduce_latency_us is None:
        raise ValueError(
            f"hardware {hw.name!r} has no interconnect figures (interconnect_gb_s, "
            f"allreduce_latency_us) for tensor_parallel_size {tp}: use tp=1 or a multi-GPU profile"
        )
    bw = hw.interconnect_gb_s * 1e9
    latency = (num_allreduces + 1) * hw.allreduce_latency_us * 1e-6
    bandwidth = (
        num_allreduces * 2 * (tp - 1) / tp * allreduce_bytes + (tp - 1) / tp * gather_bytes
    ) / bw
    return latency, bandwidth


def predict_pass_time_s(
    target_config: dict[str, Any],
    hardware: str | HardwareProfile,
    tp: int,
    t: float,
    b: int,
    context_len: float,
    routing: MeasuredRouting | None = None,
    *,
    weight_bits: int | None = None,
    overhead_s: float = PASS_OVERHEAD_S,
    kv_dtype_bytes: int = 2,
    expert_bandwidth_share: float = ACHIEVED_MEMORY_SHARE,
) -> PassTime:
    """The time of one target pass of `t` query tokens per sequence over `b` sequences at mean
    context `context_len`, tensor parallel `tp` on `hardware` (the model of the module
    docstring). `target_config`: the target's config.json as a dict (a nested text_config is
    read); `routing`: measured routing (None: the uniform bound); `weight_bits`: bits per weight
    of a checkpoint whose config has no quantization_config; `overhead_s` the fixed time per pass;
    `expert_bandwidth_share` the share of the memory bandwidth the routed-expert reads reach (an
    MoE kernel with a few tokens per expert may reach less than a device copy; default the same
    share as every other read, until a GPU measurement says otherwise)."""
    hw = hardware_profile(hardware)
    if hw.bf16_tflops is None or not hw.memory_tb_s:
        raise ValueError(f"hardware {hw.name!r} has no GPU figures; use a GPU profile")
    if tp < 1 or b < 1 or t <= 0:
        raise ValueError(f"tp={tp}, b={b}, t={t}: each must be positive")
    tc = target_config.get("text_config") or target_config
    g = count_target_param_groups(tc)
    bpp = weight_bytes(target_config, weight_bits)
    n = t * b
    attn_sharded, attn_repl, attn_core = _attention_parts(tc)
    L = g["num_layers"]
    if g["num_experts"]:
        if routing is not None and (
            routing.num_experts != g["num_experts"] or routing.top_k != g["top_k"]
        ):
            raise ValueError(
                f"{routing.source}: routing of {routing.num_experts} experts, top {routing.top_k}, "
                f"but the target has {g['num_experts']}, top {g['top_k']}: measure its own routing"
            )
        distinct = (
            routing.distinct_experts(t, b)
            if routing is not None
            else uniform_distinct_experts(g["num_experts"], g["top_k"], n)
        )
        source = f"measured ({routing.source})" if routing is not None else UNIFORM_ROUTING
    else:
        distinct, source = 0.0, "dense target (no routed experts)"
    wb = {
        "attention": L * attn_sharded * bpp["attention"] / tp,
        "replicated": L * attn_repl * bpp["attention"] + g["router"] * bpp["router"],
        "dense_mlp": g["dense_mlp"] * bpp["dense_mlp"] / tp,
        "shared_experts": g["shared_experts"] * bpp["shared_experts"] / tp,
        "routed_experts": g["num_moe_layers"] * distinct * g["expert"] * bpp["routed_experts"] / tp,
        "lm_head": g["lm_head"] * bpp["lm_head"] / tp,
        "embedding": n * int(tc["hidden_size"]) * bpp["lm_head"],
    }
    kv = b * (context_len + t) * kv_bytes_per_token_per_gpu(tc, tp, kv_dtype_bytes)
    bandwidth = hw.memory_tb_s * 1e12
    memory_s = (sum(wb.values()) - wb["routed_experts"] + kv) / (bandwidth * ACHIEVED_MEMORY_SHARE)
    memory_s += wb["routed_experts"] / (bandwidth * expert_bandwidth_share)
    k_active = g["top_k"] + g["num_shared_experts"]
    dense_per_token = L * attn_sharded + g["dense_mlp"] + g["num_moe_layers"] * k_active * g[
        "expert"
    ] + g["lm_head"]  # fmt: skip
    flops = (
        2
        * n
        * (dense_per_token / tp + L * attn_repl + g["router"] + L * attn_core * context_len / tp)
    )
    compute_s = flops / (hw.bf16_tflops * 1e12 * ACHIEVED_MATMUL_SHARE)
    act = n * int(tc["hidden_size"]) * ACTIVATION_BYTES
    lat, bw = comm_time_s(hw, tp, 2 * L + 1, act, n * int(tc["vocab_size"]) * ACTIVATION_BYTES)
    total = max(memory_s, compute_s) + lat + bw + overhead_s
    return PassTime(
        t=t,
        b=b,
        tp=tp,
        context_len=context_len,
        hardware=hw.name,
        routing_source=source,
        distinct_experts_per_layer=distinct,
        weight_bytes=wb,
        kv_bytes=kv,
        flops=flops,
        memory_s=memory_s,
        compute_s=compute_s,
        allreduce_latency_s=lat,
        allreduce_bandwidth_s=bw,
        comm_s=lat + bw,
        overhead_s=overhead_s,
        total_s=total,
        bound="memory" if memory_s >= compute_s else "compute",
        bytes_per_param=bpp,
    )


# ------------------------------------------------------------------------------------ the draft


@dataclass(frozen=True)
class DraftWeights:
    """What one EAGLE draft step reads: its decoder layers + lm_head over the draft vocabulary +
    norms (`step_bytes`), its fc once per round (`fc_bytes`), from the exported draft's safetensors
    (eagle3.evaluate.cost); its shape for the all-reduces and the KV it reads."""

    step_bytes: float
    fc_bytes: float
    num_layers: int
    hidden_size: int
    draft_vocab_size: int
    kv_bytes_per_token: float


def draft_groups(draft: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(parameters, bytes) per tensor group of the exported draft, from the safetensors headers
    (exact): fc, layers (the decoder layers: midlayer.* / layers.*), lm_head, norm; the maps
    d2t/t2d and a carried embedding are not weights the draft reads per step (vLLM shares the
    target's embedding)."""
    from safetensors import safe_open

    groups: dict[str, int] = {"fc": 0, "layers": 0, "lm_head": 0, "norm": 0}
    nbytes = dict(groups)
    for f in sorted(draft.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name in ("d2t", "t2d") or "embed_tokens" in name:
                    continue
                sl = st.get_slice(name)
                n = math.prod(sl.get_shape())
                if name.startswith("fc."):
                    g = "fc"
                elif name.startswith("lm_head"):
                    g = "lm_head"
                elif name.startswith(("midlayer.", "layers.")):
                    g = "layers"
                else:
                    g = "norm"
                groups[g] += n
                nbytes[g] += n * _SAFETENSORS_BYTES.get(sl.get_dtype(), 2)
    return groups, nbytes


#: safetensors dtype name -> bytes per value
_SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8, "I32": 4}


def draft_weights(draft: Path) -> DraftWeights:
    """What the exported draft's steps read (eagle3.step_time.DraftWeights): bytes of its layers,
    lm_head and norms per step, of its fc once per round, from its safetensors; its shape from its
    config.json."""
    _, nbytes = draft_groups(draft)
    cfg = read_json(draft / "config.json")
    H = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    kvh = int(cfg.get("num_key_value_heads") or nh)
    d = int(cfg.get("head_dim") or H // nh)
    layers = int(cfg.get("num_hidden_layers") or 1)
    return DraftWeights(
        step_bytes=float(nbytes["layers"] + nbytes["lm_head"] + nbytes["norm"]),
        fc_bytes=float(nbytes["fc"]),
        num_layers=layers,
        hidden_size=H,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        kv_bytes_per_token=float(layers * 2 * kvh * d * 2),
    )


def draft_weights_from_dims(m: dict[str, int], dtype_bytes: int = 2) -> DraftWeights:
    """DraftWeights of a draft not exported yet, from its dims (eagle3.flops.draft_dims of a
    family's DraftConfig): its parameters (eagle3.flops.count_draft_params) at `dtype_bytes`."""
    p = {name: n for name, (n, _) in count_draft_params(m).items()}
    layers = int(m.get("n_layers", 1))
    return DraftWeights(
        step_bytes=float((p["attn"] + p["mlp"] + p["lm_head"] + p["norms"]) * dtype_bytes),
        fc_bytes=float(p["fc"] * dtype_bytes),
        num_layers=layers,
        hidden_size=int(m["H"]),
        draft_vocab_size=int(m["Vd"]),
        kv_bytes_per_token=float(layers * 2 * m["kvh"] * m["d"] * dtype_bytes),
    )


def predict_draft_time_s(
    draft: DraftWeights,
    hardware: str | HardwareProfile,
    tp: int,
    k: int,
    b: int,
    context_len: float,
) -> float:
    """k draft steps of one token per sequence over b sequences, tensor parallel like the target
    (vLLM shards an EAGLE draft over the target's tp): each reads the draft's layers and lm_head
    (sharded) and its KV, and runs 2 all-reduces per draft layer + a logits gather; fc is read
    once per round. The draft's steps share the target pass's engine step: no PASS_OVERHEAD_S."""
    hw = hardware_profile(hardware)
    bw = hw.memory_tb_s * 1e12 * ACHIEVED_MEMORY_SHARE
    per_step = (draft.step_bytes / tp + b * context_len * draft.kv_bytes_per_token / tp) / bw
    lat, bwt = comm_time_s(
        hw,
        tp,
        2 * draft.num_layers,
        b * draft.hidden_size * ACTIVATION_BYTES,
        b * draft.draft_vocab_size * ACTIVATION_BYTES,
    )
    return k * (per_step + lat + bwt) + draft.fc_bytes / tp / bw
