"""Target-family presets: each configs/<name>.yaml against the config-only copy of its target's
config.json in configs/targets/ (no weights). Checks the capture layer ids and the derived draft."""

import json
from pathlib import Path

import pytest

from eagle3.config import AuxLayerIds, load_pipeline_config
from eagle3.model.draft import draft_config_from_target, text_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# name -> (num layers, default aux ids, draft hidden, draft intermediate, draft heads)
EXPECTED = {
    "llama-3.1-8b": (32, [2, 16, 29], 4096, 14336, 32),
    "qwen3-8b": (36, [2, 18, 33], 4096, 12288, 32),
    "qwen3-30b-a3b": (48, [2, 24, 45], 2048, 6144, 32),
    "deepseek-v3": (61, [2, 30, 58], 7168, 18432, 64),
    "kimi-k2": (61, [2, 30, 58], 7168, 18432, 64),
    "kimi-k2.5": (61, [2, 30, 58], 7168, 18432, 64),
}


#: shapes that only give `eagle3 plan` its target before the target exists locally
#: (plan.target_config)
PLAN_ONLY_SHAPES = {"refbench-target-a-llama", "smollm2-135m-instruct", "tiny-demo"}


def test_every_target_shape_has_a_preset():
    assert sorted(p.stem for p in (CONFIGS / "targets").glob("*.json")) == sorted(
        [*EXPECTED, *PLAN_ONLY_SHAPES]
    )
    used = {
        Path(load_pipeline_config(p).plan.get("target_config", "")).stem
        for p in CONFIGS.glob("*.yaml")
    }
    assert set(EXPECTED) | PLAN_ONLY_SHAPES <= used, (
        "a shape in configs/targets/ that no preset's plan: names"
    )


#: presets of a family's other serving mode: preset -> the target shape it shares
VARIANTS = {"kimi-k2.5-thinking": "kimi-k2.5"}


@pytest.mark.parametrize("name", sorted([*EXPECTED, *VARIANTS]))
def test_preset_derives_layers_and_draft(name):
    cfg = load_pipeline_config(CONFIGS / f"{name}.yaml").resolved()
    shape = VARIANTS.get(name, name)
    target_cfg = json.loads((CONFIGS / "targets" / f"{shape}.json").read_text())
    tc = text_config(target_cfg)
    num_layers, aux_ids, hidden, inter, heads = EXPECTED[shape]
    assert tc["num_hidden_layers"] == num_layers
    layers = AuxLayerIds.resolve(cfg.capture.aux_layer_ids, num_layers).as_list()
    assert layers == aux_ids
    draft = draft_config_from_target(
        target_cfg,
        num_aux=len(layers),
        draft_vocab_size=cfg.vocab.draft_vocab_size,
        overrides=cfg.train.draft,
    )
    assert (draft.hidden_size, draft.intermediate_size, draft.num_attention_heads) == (
        hidden,
        inter,
        heads,
    )
    assert draft.draft_vocab_size == 32000 and draft.vocab_size == tc["vocab_size"]
    assert draft.max_position_embeddings >= tc["max_position_embeddings"]
    assert draft.num_attention_heads * draft.head_dim >= hidden // 2


def test_kimi_k25_reads_nested_text_config():
    target_cfg = json.loads((CONFIGS / "targets" / "kimi-k2.5.json").read_text())
    assert "hidden_size" not in target_cfg and target_cfg["text_config"]["hidden_size"] == 7168
    draft = draft_config_from_target(
        target_cfg,
        num_aux=3,
        draft_vocab_size=32000,
        overrides=load_pipeline_config(CONFIGS / "kimi-k2.5.yaml").train.draft,
    )
    assert draft.max_position_embeddings == 262144 and draft.vocab_size == 163840
    assert draft.bos_token_id == 163584


def test_thinking_preset_switches_every_rendering_stage():
    """The Kimi-K2.5 thinking preset's switch and trust_remote_code reach every stage that renders
    prompts or loads the tokenizer, and its lengths fit reasoning traces."""
    cfg = load_pipeline_config(CONFIGS / "kimi-k2.5-thinking.yaml").resolved()
    for section in (cfg.regenerate, cfg.prepare, cfg.refine, cfg.evaluate):
        assert section.chat_template_kwargs == {"thinking": True}
        assert section.trust_remote_code is True
    assert cfg.regenerate.max_new_tokens >= 16384
    assert cfg.regenerate.max_model_len >= cfg.regenerate.max_new_tokens
    assert cfg.prepare.max_seq_len == cfg.train.loader.max_seq_len >= 16384
