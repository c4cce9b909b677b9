"""EAGLE-3 (Li et al., 2025): a one-layer (or deeper) Llama decoder over the target's aux states,
trained with training-time test; served by vLLM as LlamaForCausalLMEagle3 (eagle3.model.eagle)."""

from eagle3.model.eagle import EagleFamily

FAMILY = EagleFamily("eagle3")
