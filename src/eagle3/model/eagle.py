"""The EAGLE-3 architecture as a draft family: what the built-in families eagle3 and eagle3.1 share.

Both build eagle3.model.draft.Eagle3Draft; EAGLE-3.1 turns on its two switches (fc_norm: one
RMSNorm per aux state before fc; norm_output: the next step reads the final norm's output), which
its exported config.json names as vLLM 0.32's llama_eagle3.py reads them (absent = off, so an
EAGLE-3 config is unchanged). Served by vLLM's "eagle3" method.

format=vllm (LlamaForCausalLMEagle3): architectures, model_type llama, the draft's dimensions,
    vocab_size (the target's), draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids,
    target_hidden_size when it differs, norm_before_residual false.
format=speculators (speculators_model_type eagle3, as vLLM's speculators config reader and the
    speculators library's Eagle3SpeculatorConfig expect): transformer_layer_config (the llama
    config of the layer), draft_vocab_size, norm_before_residual false (its reader defaults to TRUE
    when absent), target_hidden_size, eagle_aux_hidden_state_layer_ids, speculators_config
    {algorithm, proposal_methods, verifier}, fc_norm / norm_output (vLLM's speculators reader,
    update_eagle3, passes both through).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eagle3.model.draft import DraftConfig, Eagle3Draft, draft_config_from_target


@dataclass(frozen=True)
class EagleFamily:
    """An EAGLE-3 family (eagle3.model.family.DraftFamily): its name and its switches."""

    name: str
    fc_norm: bool = False
    norm_output: bool = False
    vllm_method: str = "eagle3"
    export_formats: tuple[str, ...] = ("vllm", "speculators")

    def draft_config(
        self, target_cfg: dict[str, Any], num_aux: int, draft_vocab_size: int, options: Any
    ) -> DraftConfig:
        cfg = draft_config_from_target(target_cfg, num_aux, draft_vocab_size, options)
        return dataclasses.replace(
            cfg, family=self.name, fc_norm=self.fc_norm, norm_output=self.norm_output
        )

    def build(self, cfg: DraftConfig) -> Eagle3Draft:
        return Eagle3Draft(cfg)

    def export_config(
        self, cfg: DraftConfig, aux_layer_ids: list[int], fmt: str, verifier: dict[str, Any]
    ) -> dict[str, Any]:
        if fmt == "speculators":
            return speculators_config(cfg, aux_layer_ids, verifier)
        return vllm_config(cfg, aux_layer_ids)


def layer_config(dcfg: DraftConfig) -> dict[str, Any]:
    """The draft's decoder layers as a Llama config."""
    rope = {"rope_type": "default", **(dcfg.rope_scaling or {}), "rope_theta": dcfg.rope_theta}
    return {
        "model_type": "llama",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "num_hidden_layers": dcfg.num_hidden_layers,
        "hidden_act": "silu",
        "max_position_embeddings": dcfg.max_position_embeddings,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_parameters": rope,
        "vocab_size": dcfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": dcfg.bos_token_id,
        "eos_token_id": dcfg.eos_token_id,
        "torch_dtype": "bfloat16",
    }


def eagle31_keys(dcfg: DraftConfig) -> dict[str, bool]:
    """The EAGLE-3.1 switches, only those that are on (vLLM reads both as getattr(config, key,
    False))."""
    return {k: True for k in ("fc_norm", "norm_output") if getattr(dcfg, k)}


def vllm_config(dcfg: DraftConfig, ids: list[int]) -> dict[str, Any]:
    """config.json of format vllm (LlamaForCausalLMEagle3)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(dcfg)}
    cfg["draft_vocab_size"] = dcfg.draft_vocab_size
    cfg["norm_before_residual"] = False
    if dcfg.target_hidden_size != dcfg.hidden_size:
        cfg["target_hidden_size"] = dcfg.target_hidden_size
    cfg["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "use_aux_hidden_state": True,
    }
    return {**cfg, **eagle31_keys(dcfg)}


def speculators_config(
    dcfg: DraftConfig, ids: list[int], verifier: dict[str, Any]
) -> dict[str, Any]:
    """config.json of format speculators (speculators_model_type eagle3)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "transformer_layer_config": layer_config(dcfg),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": dcfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        **eagle31_keys(dcfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": verifier.get("name_or_path"),
                "architectures": verifier.get("architectures", []),
            },
        },
        "torch_dtype": "bfloat16",
    }
