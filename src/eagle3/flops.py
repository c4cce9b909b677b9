"""FLOP, parameter and byte counts: the EAGLE-3 draft's training step and the target's forward pass.

Pure arithmetic on config dimensions (no torch, no pydantic), shared by benchmarks/train_step.py
(its FLOP/byte floors) and eagle3.plan (capture and training time estimates). Convention everywhere:
2 FLOPs per multiply-add, counts per token.

Draft dims (`m`): H (draft hidden), Ht (target hidden), n_aux, nh, kvh, d (head dim), inter, V
(target vocab), Vd (draft vocab); `draft_dims(DraftConfig)` builds it.
"""

from __future__ import annotations

from typing import Any


def draft_dims(cfg: Any) -> dict[str, int]:
    """The `m` dict of the counts below from a DraftConfig (or anything with its attribute
    names)."""
    return dict(
        H=cfg.hidden_size,
        Ht=cfg.target_hidden_size,
        n_aux=cfg.num_aux,
        nh=cfg.num_attention_heads,
        kvh=cfg.num_key_value_heads,
        d=cfg.head_dim,
        inter=cfg.intermediate_size,
        V=cfg.vocab_size,
        Vd=cfg.draft_vocab_size,
        n_layers=getattr(cfg, "num_hidden_layers", 1),
    )


def count_train_flops(m: dict, T: int, K: int) -> dict:
    """Model FLOPs per token of one optimizer step (K unrolled TTT steps), the anchor's convention:

    per token per TTT step j (forward, 2 FLOPs per multiply-add):
      fc             2 * (n_aux*Ht) * H              only at step 0
      qkv            2 * 2H * (nh + 2 kvh) * d       q, k, v read concat(embed, hidden) = 2H
      attn_core      4 * nh * d * (T/2 + j)          QK^T + PV over the causal half of the step-0
                                                     keys + j TTT keys
      o_proj         2 * nh*d * H
      mlp            3 * 2 * H * inter               gate, up, down
      draft_lm_head  2 * H * Vd
    trainable total x3 (backward ~ 2x forward); plus the frozen target lm_head restricted to the
    draft vocab (target distribution), forward only, ONCE per token: targets are computed once per
    batch and each TTT step reads them shifted by j (eagle3.train.loss.compute_targets). The
    out-of-vocab mask also needs the target's full-vocab argmax: the trainer computes it once per
    sample before training (not per step since 2026-12-01), a streaming run in the step from the
    full-vocab head: `target_lm_head_full` and `executed_flops_per_token_incl_full_vocab_argmax`
    give that case (not in the model count, which, like the peer, restricts the target head to the
    draft vocab).
    """
    H, Ht, nh, kvh, d, inter, V, Vd, na = (
        m[k] for k in ("H", "Ht", "nh", "kvh", "d", "inter", "V", "Vd", "n_aux")
    )
    n = m.get("n_layers", 1)  # layers after the first read width H, not 2H
    fwd = {
        "fc": 2 * na * Ht * H,
        "qkv": K * 2 * (2 * H + (n - 1) * H) * (nh + 2 * kvh) * d,
        "attn_core": n * sum(4 * nh * d * (T / 2 + j) for j in range(K)),
        "o_proj": n * K * 2 * nh * d * H,
        "mlp": n * K * 3 * 2 * H * inter,
        "draft_lm_head": K * 2 * H * Vd,
    }
    trainable_fwd = sum(fwd.values())
    target = 2 * Ht * Vd
    total = 3 * trainable_fwd + target
    return {
        "convention": "per token per optimizer step; trainable x3 (fwd + 2x bwd); frozen target "
        "lm_head restricted to the draft vocab, forward only, once per token; attention = causal "
        "half of step-0 keys + j TTT keys",
        "forward_per_token": {k: float(v) for k, v in fwd.items()},
        "trainable_forward_per_token": float(trainable_fwd),
        "trainable_fwd_bwd_per_token": float(3 * trainable_fwd),
        "target_lm_head_restricted_per_token": float(target),
        "target_lm_head_full_per_token": float(2 * Ht * V),
        "model_flops_per_token": float(total),
        "model_flops_per_token_unrestricted_target": float(3 * trainable_fwd + 2 * Ht * V),
        "executed_flops_per_token_incl_full_vocab_argmax": float(3 * trainable_fwd + 2 * Ht * V),
    }


def count_draft_params(m: dict) -> dict:
    """Trainable parameter counts and how many times per optimizer step each is used (fc: once;
    midlayer/lm_head: K)."""
    H, Ht, nh, kvh, d, inter, Vd, na = (
        m[k] for k in ("H", "Ht", "nh", "kvh", "d", "inter", "Vd", "n_aux")
    )
    n = m.get("n_layers", 1)
    return {
        "fc": (na * Ht * H, "once"),
        "attn": ((2 * H + (n - 1) * H) * (nh + 2 * kvh) * d + n * nh * d * H, "per_step"),
        "mlp": (n * 3 * H * inter, "per_step"),
        "lm_head": (Vd * H, "per_step"),
        "norms": ((2 + 2 * n) * H, "per_step"),
    }


def count_step_bytes(m: dict, K: int) -> dict:
    """Bytes floor of one optimizer step: weights + grads + optimizer state only (activations
    excluded).

    fp32 master weights, bf16 autocast copies, fp32 grads, fused AdamW (fp32 m, v):
      once per step, per trainable param:  cast fp32->bf16 (read 4 + write 2)
                                           + grad-norm clip (read 4)
                                           + AdamW (read p, g, m, v = 16; write p, m, v = 12)
                                           = 38 B
      per use (fc once, the rest K times): bf16 weight read fwd (2) + bwd dX (2) + dW write bf16 (2)
                                           + fp32 grad accumulate (read 4 + write 4)
                                           = 14 B
      frozen: target lm_head's draft-vocab rows read once in bf16 (2 B each; the full-vocab argmax
      is per sample)
    """
    once_b, use_b = 38, 14
    total, terms = 0, {}
    for name, (n, when) in count_draft_params(m).items():
        uses = 1 if when == "once" else K
        b = n * (once_b + use_b * uses)
        terms[name] = float(b)
        total += b
    frozen = 2 * m["Ht"] * m["Vd"]
    terms["target_lm_head_frozen"] = float(frozen)
    total += frozen
    n_train = sum(n for n, _ in count_draft_params(m).values())
    return {
        "trainable_params": n_train,
        "terms": terms,
        "bytes_per_step": float(total),
        "convention": f"{once_b} B/param once (cast, clip, AdamW) + {use_b} B/param per use (bf16 "
        "reads fwd/bwd, dW, fp32 grad accumulate); frozen target head read once; activations "
        "excluded",
    }


# --------------------------------------------------------------------------------------- the target


def _layer_kinds(tc: dict) -> list[str]:
    """'dense' or 'moe' for each decoder layer (DeepSeek-V3 / Kimi: first_k_dense_replace dense
    layers, then MoE every moe_layer_freq; Qwen3-MoE: MoE where (i+1) % decoder_sparse_step == 0 and
    i not in mlp_only_layers)."""
    L = int(tc["num_hidden_layers"])
    if tc.get("n_routed_experts"):
        k, freq = int(tc.get("first_k_dense_replace") or 0), int(tc.get("moe_layer_freq") or 1)
        return ["moe" if i >= k and i % freq == 0 else "dense" for i in range(L)]
    if tc.get("num_experts"):
        step, dense = int(tc.get("decoder_sparse_step") or 1), set(tc.get("mlp_only_layers") or [])
        return ["moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(L)]
    return ["dense"] * L


def _attention_terms(tc: dict) -> tuple[int, int]:
    """(projection parameters per layer, attention-core multiply-adds per token per key): MLA
    (DeepSeek-V3 / Kimi: low-rank q and kv, computed un-absorbed as in prefill) or standard
    multi-head/grouped-query attention."""
    H, nh = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    if tc.get("kv_lora_rank"):
        nope, rope, v = (
            int(tc["qk_nope_head_dim"]),
            int(tc["qk_rope_head_dim"]),
            int(tc["v_head_dim"]),
        )
        qr, kvr = tc.get("q_lora_rank"), int(tc["kv_lora_rank"])
        q = H * int(qr) + int(qr) * nh * (nope + rope) if qr else H * nh * (nope + rope)
        kv = H * (kvr + rope) + kvr * nh * (nope + v)
        return q + kv + nh * v * H, nh * (nope + rope + v)
    d = int(tc.get("head_dim") or H // nh)
    kvh = int(tc.get("num_key_value_heads") or nh)
    return H * d * (nh + 2 * kvh) + nh * d * H, 2 * nh * d


def count_target_params(tc: dict) -> dict:
    """Parameters of the target's language model (`tc` = text config): total, and active per token
    (MoE: the routed experts a token uses + shared experts + dense parts). Norms and router biases
    are left out."""
    H, V = int(tc["hidden_size"]), int(tc["vocab_size"])
    attn, _ = _attention_terms(tc)
    dense_mlp = 3 * H * int(tc["intermediate_size"])
    moe_inter = int(tc.get("moe_intermediate_size") or 0)
    n_experts = int(tc.get("n_routed_experts") or tc.get("num_experts") or 0)
    k = int(tc.get("num_experts_per_tok") or 0)
    shared = int(tc.get("n_shared_experts") or 0)
    total = active = 0
    for kind in _layer_kinds(tc):
        if kind == "dense":
            total += attn + dense_mlp
            active += attn + dense_mlp
        else:
            router = H * n_experts
            total += attn + router + (n_experts + shared) * 3 * H * moe_inter
            active += attn + router + (k + shared) * 3 * H * moe_inter
    embed = V * H * (1 if tc.get("tie_word_embeddings") else 2)
    return {
        "total": total + embed,
        "active_per_token": active + V * H,
        "layers_total": total,
        "layers_active_per_token": active,
        "embedding_and_lm_head": embed,
    }


def count_target_forward_flops(tc: dict, seq_len: float) -> dict:
    """Forward FLOPs per token of a prefill over prompts of `seq_len` tokens (what capture runs):
    the decoder layers' active weights (2 per active parameter) + attention over the causal half of
    the prompt (seq_len / 2 keys on average). The lm_head is left out: the engine computes logits
    for one position per prompt only."""
    p = count_target_params(tc)
    _, core = _attention_terms(tc)
    L = int(tc["num_hidden_layers"])
    weights = 2 * p["layers_active_per_token"]
    attn = 2 * core * (seq_len / 2) * L
    return {
        "weights": float(weights),
        "attention_core": float(attn),
        "total": float(weights + attn),
        "convention": "per prompt token; 2 FLOPs per active decoder parameter + attention over "
        "seq_len/2 keys; no lm_head (logits for one position per prompt)",
    }


def kv_cache_bytes_per_token(tc: dict, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token of context holds across the layers: MLA keeps the compressed kv
    (kv_lora_rank + qk_rope_head_dim per layer), grouped-query attention a key and a value per
    kv head."""
    L = int(tc["num_hidden_layers"])
    if tc.get("kv_lora_rank"):
        return L * (int(tc["kv_lora_rank"]) + int(tc["qk_rope_head_dim"])) * dtype_bytes
    nh = int(tc["num_attention_heads"])
    d = int(tc.get("head_dim") or int(tc["hidden_size"]) // nh)
    kvh = int(tc.get("num_key_value_heads") or nh)
    return L * 2 * kvh * d * dtype_bytes


def count_target_param_groups(tc: dict) -> dict[str, int]:
    """The target's parameters by what a decode pass reads them for (`tc` = text config):
    attention projections (all layers), dense MLPs (the dense layers), routers, shared experts
    (all MoE layers), one routed expert (`expert`: gate, up, down), the routed experts of all MoE
    layers, the lm_head and the embedding; with the layer counts and the routing (`num_experts`,
    `top_k`; 0 for a dense model). Norms and router biases are left out, as in
    count_target_params."""
    H, V = int(tc["hidden_size"]), int(tc["vocab_size"])
    attn, _ = _attention_terms(tc)
    kinds = _layer_kinds(tc)
    num_moe = kinds.count("moe")
    num_dense = len(kinds) - num_moe
    n_experts = int(tc.get("n_routed_experts") or tc.get("num_experts") or 0)
    expert = 3 * H * int(tc.get("moe_intermediate_size") or 0)
    shared = int(tc.get("n_shared_experts") or 0)
    return {
        "attention": len(kinds) * attn,
        "dense_mlp": num_dense * 3 * H * int(tc["intermediate_size"]),
        "router": num_moe * H * n_experts,
        "shared_experts": num_moe * shared * expert,
        "expert": expert,
        "routed_experts": num_moe * n_experts * expert,
        "lm_head": V * H,
        "embedding": V * H,
        "num_layers": len(kinds),
        "num_moe_layers": num_moe,
        "num_experts": n_experts,
        "num_shared_experts": shared if num_moe else 0,
        "top_k": int(tc.get("num_experts_per_tok") or 0) if n_experts else 0,
    }
