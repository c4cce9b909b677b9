"""A random-weight EAGLE-3 draft directory that vLLM loads (`LlamaForCausalLMEagle3`).

For tests and plumbing checks without a trained draft: the layout is exactly what vLLM's
`vllm/model_executor/models/llama_eagle3.py` loads (one decoder layer under `midlayer.*`, the `fc`
that fuses the aux hidden states, `norm`, a `lm_head` over the draft vocabulary and the `d2t`/`t2d`
maps); the target's embedding is shared (no `embed_tokens` in the file). Acceptance of a random
draft is ~0, so τ ≈ 1; it proves the wiring, not quality.

    from tests.random_draft import build_random_draft
    build_random_draft("path/to/target", "path/to/draft", draft_vocab_size=256)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3.io import atomic_dir


@dataclass
class RandomDraft:
    path: Path
    aux_layer_ids: list[int]
    draft_vocab_size: int
    vocab_size: int
    hidden_size: int


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """(2, L//2, L-3), the EAGLE-3 default, in vLLM semantics (id k = output of decoder layer
    k-1)."""
    return [2, num_layers // 2, num_layers - 3]


def build_random_draft(
    target: str | Path,
    out: str | Path,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    std: float = 0.02,
) -> RandomDraft:
    """Write a random EAGLE-3 draft for `target` into `out` (atomically) and describe it.

    `draft_vocab_size` (default: the target's vocab) picks the draft vocabulary as the first
    `draft_vocab_size` target token ids, so `d2t` is all zeros and `t2d` marks that prefix.
    """
    import torch
    from safetensors.torch import save_file

    target = Path(target)
    tcfg = json.loads((target / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    H = int(tcfg["hidden_size"])
    inter = int(tcfg["intermediate_size"])
    nh = int(tcfg["num_attention_heads"])
    nkv = int(tcfg.get("num_key_value_heads", nh))
    hd = int(tcfg.get("head_dim") or H // nh)
    V = int(tcfg["vocab_size"])
    L = int(tcfg["num_hidden_layers"])
    dv = int(draft_vocab_size or V)
    if not 0 < dv <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V} (the target's vocab), got {dv}")
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(L)
    if any(not 0 <= a <= L for a in aux):
        raise ValueError(f"aux_layer_ids must be in 0..{L} for a {L}-layer target, got {aux}")
    if len(set(aux)) != len(aux):
        # vLLM collects each aux layer once, so duplicates would break the fc input width
        raise ValueError(
            f"aux_layer_ids has duplicates {aux} (the default for a {L}-layer target); pass "
            f"distinct ids, e.g. [1, {L // 2}, {L - 1}]"
        )
    torch_dtype = getattr(torch, dtype)

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch_dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch_dtype)

    tensors = {
        "fc.weight": rnd(H, len(aux) * H),
        "midlayer.input_layernorm.weight": ones(H),
        "midlayer.hidden_norm.weight": ones(H),
        "midlayer.post_attention_layernorm.weight": ones(H),
        "midlayer.self_attn.q_proj.weight": rnd(nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, nh * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, H),
        "midlayer.mlp.up_proj.weight": rnd(inter, H),
        "midlayer.mlp.down_proj.weight": rnd(H, inter),
        "norm.weight": ones(H),
        "lm_head.weight": rnd(dv, H),
        # draft id i -> target id i + d2t[i]; t2d[t] = target id t is in the draft vocab
        "d2t": torch.zeros(dv, dtype=torch.int64),
        "t2d": torch.arange(V) < dv,
    }
    rope = {
        k: tcfg[k]
        for k in ("rope_parameters", "rope_theta", "rope_scaling")
        if tcfg.get(k) is not None
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "vocab_size": V,
        "draft_vocab_size": dv,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "dtype": dtype,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        **rope,
    }
    out = Path(out)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return RandomDraft(
        path=out, aux_layer_ids=aux, draft_vocab_size=dv, vocab_size=V, hidden_size=H
    )
