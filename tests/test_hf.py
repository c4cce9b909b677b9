"""eagle3.hf: transformers loads from several threads leave weight tying intact, and an untied load
of a tied config is refused (the CI failure of 2026-12-01: a sweep's concurrent in-process loads
left PreTrainedModel.tie_weights a no-op, and SmolLM2 then loaded with a random lm_head)."""

from __future__ import annotations

import threading

import pytest

from eagle3.hf import UntiedWeightsError, load_causal_lm


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tied-llama")
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def is_tied(model) -> bool:
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_concurrent_loads_keep_tie_weights(tied_llama):
    from transformers import PreTrainedModel

    original = PreTrainedModel.tie_weights
    errors: list[BaseException] = []

    def load_many() -> None:
        try:
            for _ in range(6):
                assert is_tied(load_causal_lm(tied_llama))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=load_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert PreTrainedModel.tie_weights is original
    assert is_tied(load_causal_lm(tied_llama))


def test_a_tied_config_loaded_untied_is_refused(tied_llama, monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(
        PreTrainedModel, "tie_weights", lambda self, *a, **k: None
    )  # what the race leaves behind
    with pytest.raises(
        UntiedWeightsError, match="tie_word_embeddings=true.*lm_head separate from embed_tokens"
    ):
        load_causal_lm(tied_llama)
