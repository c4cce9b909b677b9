"""Loading transformers causal LMs safely when several threads of one process load models.

transformers 5's `from_pretrained` replaces `PreTrainedModel.tie_weights` with a no-op while it
builds the model (`transformers.initialization.no_tie_weights`) and puts back what it found there
when it is done. Two loads in threads of one process (a layer sweep whose branches run in process
with `max_concurrency` > 1) interleave so that the second one saves the no-op as "the original" and
restores it last: from then on no model in that process ties its weights, and a target with tied
embeddings (SmolLM2, Llama-3.2, Qwen3-0.6B) loads with a freshly initialised lm_head and writes
nonsense (found by CI: SmolLM2 answered " fetus fetus Zoo Zoo" in a test that ran after the sweep
test). Every model eagle3 loads with transformers goes through `load_causal_lm`, which holds one
process-wide lock for the load and then checks that a model whose config ties its embeddings really
has one matrix for both.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

#: held while transformers builds a model (see the module docstring)
LOAD_LOCK = threading.RLock()


class UntiedWeightsError(RuntimeError):
    """A model whose config ties its input and output embeddings was built with two matrices."""


def check_tied(model: Any, source: str | Path) -> None:
    """Raise UntiedWeightsError when `model`'s config ties the word embeddings but its lm_head is
    its own matrix."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    if not getattr(config, "tie_word_embeddings", False):
        return
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or emb is None or out.weight.data_ptr() == emb.weight.data_ptr():
        return
    import transformers

    raise UntiedWeightsError(
        f"{source}: config.json says tie_word_embeddings=true, but transformers "
        f"{transformers.__version__} built the model with an lm_head separate from embed_tokens (a "
        "random one when the checkpoint has none). Something in this process replaced "
        "PreTrainedModel.tie_weights (transformers swaps it out during every load; two loads in "
        "threads that bypass eagle3.hf.load_causal_lm leave it a no-op). Load models through "
        "eagle3.hf.load_causal_lm, or run the loads in separate processes."
    )


def load_causal_lm(path: str | Path, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` under LOAD_LOCK, checked by
    `check_tied`."""
    from transformers import AutoModelForCausalLM

    with LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    check_tied(model, path)
    return model
