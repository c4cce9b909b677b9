"""The tensors vLLM's EAGLE-3 loader (llama_eagle3.py, LlamaForCausalLMEagle3) reads from an
exported draft, written out by hand from its layout: the spec the EAGLE families' export_state_dict
is checked against (export itself checks a checkpoint against the family's own draft)."""

from __future__ import annotations

from eagle3.model.draft import DraftConfig


def expected_export_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every key (and its shape) an exported draft must hold, nothing more."""
    H, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def layer(p: str, width: int) -> dict[str, tuple[int, ...]]:
        return {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nq, width),
            p + "self_attn.k_proj.weight": (nkv, width),
            p + "self_attn.v_proj.weight": (nkv, width),
            p + "self_attn.o_proj.weight": (H, nq),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }

    shapes = {
        "fc.weight": (H, cfg.num_aux * cfg.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        **layer("midlayer.", 2 * H),
    }
    if cfg.fc_norm:
        shapes.update(
            {f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(cfg.num_aux)}
        )
    for k in range(1, cfg.num_hidden_layers):
        shapes.update(layer(f"layers.{k}.", H))
    return {
        **shapes,
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
