"""The EAGLE-3 draft model, in the layout vLLM's `LlamaForCausalLMEagle3` loads (llama_eagle3.py);
the module both built-in draft families build (eagle3.model.eagle), and DraftConfig, the shape every
family records.

    fc_norm.i     EAGLE-3.1 only (`fc_norm`): one RMSNorm per aux state (width H_target) before fc
    fc            (n_aux*H_target -> H, no bias) over the concatenated aux hidden states of the
                  target
    midlayer      one Llama decoder layer whose q/k/v read concat(input_layernorm(embed),
                  hidden_norm(h)), width 2H
    layers.k      optional further plain Llama decoder layers k = 1 .. num_hidden_layers-1 (vLLM
                  0.32 builds them from `num_hidden_layers`; each adds the residual, then norm ->
                  attention/MLP, as in Llama)
    norm          final RMSNorm; its *pre-norm* input (mlp_out + residual) is the hidden fed to the
                  next draft step (EAGLE-3.1 `norm_output`: its *output* is fed instead, as vLLM's
                  LlamaModel returns it as aux_output)
    lm_head       H -> draft_vocab
    d2t / t2d     draft id -> target id offsets (target = i + d2t[i]); target-id membership mask
    embed_tokens  copied from the target and frozen; not exported (vLLM shares the target's
                  embedding)

Semantics follow vLLM with `norm_before_residual=False`: the residual stream starts from the raw
fc/previous hidden, `hidden_norm` only feeds attention. Training-time test (TTT) runs `step()` K
times; the attention kernel that sees the keys of earlier steps is passed in
(eagle3.train.attention), so this file stays pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class DraftConfigError(ValueError):
    """A draft dimension is wrong; the message names the field, the bad value and the fix."""


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    vocab_size: int  # target vocab (embedding rows, d2t targets)
    draft_vocab_size: int
    target_hidden_size: int
    num_aux: int  # number of aux hidden states the fc reads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = (
        None  # rope_parameters minus rope_theta ({"rope_type": "llama3", ...})
    )
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_hidden_layers: int = 1  # decoder layers: the midlayer + (n-1) plain ones
    dropout: float = 0.0  # on each layer's attention and MLP outputs, training only (not exported)
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm each aux state before fc (vLLM config key `fc_norm`)
    norm_output: bool = (
        False  # EAGLE-3.1: the next step reads the post-norm state (vLLM config key `norm_output`)
    )
    family: str = "eagle3"  # the draft family that builds it (eagle3.model.family)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise DraftConfigError(
                f"draft config has unknown keys {sorted(unknown)}; expected a subset of "
                f"{sorted(names)}"
            )
        return cls(**d)


def text_config(target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of an HF config.json (nested `text_config` for multimodal
    targets)."""
    return target_cfg.get("text_config") or target_cfg


def target_rope(tc: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either transformers-5 `rope_parameters` or v4
    `rope_theta`/`rope_scaling`."""
    params = dict(tc.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", tc.get("rope_theta", 10000.0)))
    scaling = params or tc.get("rope_scaling") or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if (
        scaling and "type" in scaling
    ):  # v4 key (Kimi-K2.5, DeepSeek-V3): vLLM and the export read rope_type
        scaling = {
            "rope_type": scaling["type"],
            **{k: v for k, v in scaling.items() if k != "type"},
        }
    return theta, scaling


def draft_config_from_target(
    target_cfg: dict[str, Any], num_aux: int, draft_vocab_size: int, overrides: Any = None
) -> DraftConfig:
    """Derive the draft's dimensions from the target's config.json; `overrides`
    (eagle3.config.train_options.DraftOptions) wins per dimension it sets. The family's switches
    are its own (eagle3.model.family.DraftFamily.draft_config sets them)."""
    tc = text_config(target_cfg)
    ov = overrides.shape() if overrides is not None else {}
    H = tc["hidden_size"]
    heads = tc["num_attention_heads"]
    theta, scaling = target_rope(tc)
    cfg = DraftConfig(
        hidden_size=ov.get("hidden_size", H),
        intermediate_size=ov.get("intermediate_size", tc["intermediate_size"]),
        num_attention_heads=ov.get("num_attention_heads", heads),
        num_key_value_heads=ov.get("num_key_value_heads", tc.get("num_key_value_heads", heads)),
        # MLA targets (DeepSeek-V3, Kimi) have no plain head: their `head_dim`, where written, is
        # the rope part
        head_dim=ov.get(
            "head_dim", (None if tc.get("kv_lora_rank") else tc.get("head_dim")) or H // heads
        ),
        max_position_embeddings=ov.get(
            "max_position_embeddings", tc.get("max_position_embeddings", 4096)
        ),
        rms_norm_eps=ov.get("rms_norm_eps", tc.get("rms_norm_eps", 1e-6)),
        vocab_size=tc["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=H,
        num_aux=num_aux,
        rope_theta=ov.get("rope_theta", theta),
        rope_scaling=scaling,
        bos_token_id=tc.get("bos_token_id", target_cfg.get("bos_token_id")),
        eos_token_id=tc.get("eos_token_id", target_cfg.get("eos_token_id")),
        num_hidden_layers=ov.get(
            "num_hidden_layers", 1
        ),  # the draft's own depth, never the target's
    )
    check_draft_config(cfg, tc)
    return cfg


def check_draft_config(cfg: DraftConfig, tc: dict[str, Any]) -> None:
    """Refuse drafts vLLM could not serve next to this target."""
    if cfg.hidden_size != tc["hidden_size"]:
        raise DraftConfigError(
            f"draft.hidden_size={cfg.hidden_size} differs from the target's "
            f"hidden_size={tc['hidden_size']}: the draft shares the target's token embedding, so "
            "unset draft.hidden_size"
        )
    tmax = tc.get("max_position_embeddings", 0)
    if cfg.max_position_embeddings < tmax:
        raise DraftConfigError(
            f"draft.max_position_embeddings={cfg.max_position_embeddings} is below the target's "
            f"{tmax}: vLLM would cap serving at the draft's length; set it to >= {tmax} or leave "
            "it unset"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise DraftConfigError(
            f"draft.num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}; pick a divisor"
        )
    if cfg.num_hidden_layers < 1:
        raise DraftConfigError(
            f"draft.num_hidden_layers={cfg.num_hidden_layers}: an EAGLE-3 draft has at least 1 "
            "layer"
        )
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        raise DraftConfigError(
            f"draft_vocab_size={cfg.draft_vocab_size} must be in [1, target vocab {cfg.vocab_size}]"
        )


# ------------------------------------------------------------------------------------------- blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (..., D)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., D)
        # in x's dtype: under autocast (bf16 x, fp32 weight) the product would otherwise be fp32,
        # and the final norm's output (the lm_head input, K times per step) would travel as (B, T,
        # H) fp32 into a bf16 GEMM
        return (self.weight * xf.to(x.dtype)).to(x.dtype)  # (..., D)


def rope_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    """Inverse frequencies for default / linear / llama3 rope (the types Llama-family targets
    use)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # (d/2,)
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv  # (d/2,)
        smooth = (old / wavelen - lo) / (hi - lo)  # (d/2,)
        mid = (1 - smooth) * inv / factor + smooth * inv  # (d/2,)
        inv = torch.where(
            wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, mid)
        )  # (d/2,)
    elif kind == "yarn":  # as vLLM's YaRNScalingRotaryEmbedding, which serves the exported draft
        factor, old = s["factor"], s["original_max_position_embeddings"]
        fast, slow = s.get("beta_fast", 32), s.get("beta_slow", 1)
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = s.get("attention_factor") or (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )
        if abs(attn - 1.0) > 1e-9:
            raise DraftConfigError(
                f"rope scaling yarn with attention factor {attn:.4f} (factor {factor}, mscale "
                f"{mscale}, mscale_all_dim {mscale_all}) is not supported by the trainer (only "
                "1.0, as Kimi-K2.5 / DeepSeek-V3 have); override draft.rope_theta and drop the "
                "scaling"
            )

        def dim_at(rot: float) -> float:
            return d * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo, hi = max(math.floor(dim_at(fast)), 0), min(math.ceil(dim_at(slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / ((hi - lo) or 0.001)).clamp(
            0, 1
        )  # (d/2,)
        inv = inv / factor * ramp + inv * (1 - ramp)  # (d/2,)
    else:
        raise DraftConfigError(
            f"rope scaling type {kind!r} is not supported by the trainer (default, linear, llama3, "
            "yarn); override draft.rope_theta and drop the scaling, or add the type to "
            "rope_inv_freq"
        )
    return inv.float()


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.float()[..., None] * inv_freq  # (B, T, d/2)
    ang = torch.cat([ang, ang], dim=-1)[:, None]  # (B, 1, T, d)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, d/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # (B, h, T, d)


#: attn_fn(q (B, nh, T, d), keys [(B, kvh, T, d)] * (j+1), values [...] * (j+1)) -> (B, nh, T, d)
AttnFn = Callable[[torch.Tensor, list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        self.nh, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(in_features, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(in_features, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape  # x: (B, T, 2H) in the midlayer, (B, T, H) in later layers
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, self.kvh, self.d).transpose(1, 2)  # (B, kvh, T, d)
        v = self.v_proj(x).view(B, T, self.kvh, self.d).transpose(1, 2)  # (B, kvh, T, d)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # (B, nh|kvh, T, d)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape  # (B, nh, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.d))  # (B, T, H)

    def forward(self, x, cos, sin, cache: tuple[list, list], attn_fn: AttnFn) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)  # (B, nh|kvh, T, d)
        cache[0].append(k)
        cache[1].append(v)
        return self.out(attn_fn(q, cache[0], cache[1]))  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, H)


class _DraftLayer(nn.Module):
    """What the draft's layers share: the part after the attention kernel."""

    p: float
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: MLP

    def post(self, residual, y) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after the attention kernel: o_proj, residual, MLP. y: (B, nh, T, d)."""
        residual = residual + F.dropout(self.self_attn.out(y), self.p, self.training)  # (B, T, H)
        h = F.dropout(
            self.mlp(self.post_attention_layernorm(residual)), self.p, self.training
        )  # (B, T, H)
        return h, residual


class MidLayer(_DraftLayer):
    """vLLM's Eagle3 LlamaDecoderLayer (layer_idx 0, norm_before_residual=False)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.p = cfg.dropout
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, cos, sin, cache, attn_fn) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.pre(emb, hidden, cos, sin)  # (B, nh|kvh, T, d)
        cache[0].append(k)
        cache[1].append(v)
        return self.post(hidden, attn_fn(q, cache[0], cache[1]))  # (B, T, H) x2

    def pre(self, emb, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the attention kernel: norms, concat, q/k/v, rope. Shapes do not depend
        on the TTT step."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        return self.self_attn.project(x, cos, sin)  # (B, nh|kvh, T, d)


class DecoderLayer(_DraftLayer):
    """vLLM's Eagle3 LlamaDecoderLayer with layer_idx > 0: a plain Llama layer on (h, residual) from
    the one before."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.p = cfg.dropout
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, residual, cos, sin, cache, attn_fn) -> tuple[torch.Tensor, torch.Tensor]:
        residual, q, k, v = self.pre(h, residual, cos, sin)  # (B, T, H), (B, nh|kvh, T, d)
        cache[0].append(k)
        cache[1].append(v)
        return self.post(residual, attn_fn(q, cache[0], cache[1]))  # (B, T, H) x2

    def pre(self, h, residual, cos, sin) -> tuple[torch.Tensor, ...]:
        residual = h + residual  # (B, T, H)
        return (residual, *self.self_attn.project(self.input_layernorm(residual), cos, sin))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.fc_norm:  # state_dict names fc_norm.i.weight, the names vLLM loads (model.fc_norm.i)
            self.fc_norm = nn.ModuleList(
                RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux)
            )
        else:
            self.fc_norm = None
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        # keys "1".."n-1": state_dict names layers.1.*, the names vLLM loads (midlayer. maps to its
        # layers.0.)
        self.layers = nn.ModuleDict(
            {str(k): DecoderLayer(cfg) for k in range(1, cfg.num_hidden_layers)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def compile_blocks(self, mode: str = "layer") -> None:
        """torch.compile what runs once per TTT step; the unrolled loop stays eager.

        layer  each decoder layer whole (attention kernel inside) + the final norm. The layer's
               graph depends on the TTT step (its KV list grows), so it is compiled K times, forward
               and backward (~2 min at K=7 on an H200).
        split  each layer's `pre` (norms, q/k/v, rope) and `post` (o_proj, residual, MLP) compiled
               on their own (static shapes): their graphs are the same at every TTT step, so each
               compiles once; the attention kernel between them is compiled by
               eagle3.train.attention (one flex kernel over the step-0 keys for all steps, plus one
               small merge of the diagonal keys per step count). Same math, same values."""
        if mode not in ("layer", "split"):
            raise ValueError(f"compile_blocks(mode={mode!r}): expected 'layer' or 'split'")
        if mode == "layer":
            self.midlayer.compile()
            for layer in self.layers.values():
                layer.compile()
        else:
            for layer in (self.midlayer, *self.layers.values()):
                # instance attributes shadow the methods; forward() calls self.pre / self.post
                layer.pre = torch.compile(layer.pre, dynamic=False)
                layer.post = torch.compile(layer.post, dynamic=False)
        self.norm.compile()

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """vLLM's combine_hidden_states: (fc_norm per aux state, then) fc. (B, T, n_aux*Ht) -> (B,
        T, H)"""
        if self.fc_norm is not None:
            chunks = aux.chunk(self.cfg.num_aux, dim=-1)  # n_aux x (B, T, Ht)
            aux = torch.cat(
                [norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1
            )  # (B, T, n_aux*Ht)
        return self.fc(aux)  # (B, T, H)

    def new_cache(self) -> list[tuple[list, list]]:
        """Per decoder layer: (keys, values) of every TTT step so far (what the layer's KV cache
        holds in vLLM)."""
        return [([], []) for _ in range(self.cfg.num_hidden_layers)]

    def step(
        self, input_ids, hidden, positions, cache, attn_fn: AttnFn, states: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: returns (normed output for lm_head, hidden for the next step), both (B,
        T, H); the hidden for the next step is the pre-norm state, or with norm_output the normed
        one (vLLM's aux_output). cache: from new_cache(), extended in place; `states`, when given,
        gets the midlayer's output (h + residual)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)  # (B, 1, T, d)
        h, residual = self.midlayer(emb, hidden, cos, sin, cache[0], attn_fn)  # (B, T, H) x2
        if states is not None:
            states.append(h + residual)  # (B, T, H)
        for k, layer in self.layers.items():
            h, residual = layer(h, residual, cos, sin, cache[int(k)], attn_fn)  # (B, T, H) x2
        prenorm = h + residual  # (B, T, H)
        out = self.norm(prenorm)  # (B, T, H)
        return out, (out if self.cfg.norm_output else prenorm)

    def forward(self, input_ids, aux, positions, attn_fn: AttnFn, steps: int = 1):
        """Unrolled TTT forward for callers that only need outputs: step j reads ids shifted by j
        (caller's job to pass `input_ids` as a list per step when it differs). Returns list of
        normed outputs (B, T, H)."""
        ids = input_ids if isinstance(input_ids, (list, tuple)) else [input_ids] * steps
        hidden, cache, outs = self.combine(aux), self.new_cache(), []  # (B, T, H)
        for j in range(steps):
            out, hidden = self.step(ids[j], hidden, positions + j, cache, attn_fn)  # (B, T, H) x2
            outs.append(out)
        return outs

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)  # (..., Vd)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under vLLM's names: [fc_norm.i.weight], fc.weight, midlayer.*, layers.k.*,
        norm.weight, lm_head.weight, d2t, t2d (no embed)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
