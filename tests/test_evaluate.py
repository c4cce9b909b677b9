"""evaluate on real vLLM: tiny random Llama target + a random EAGLE-3 draft built by eagle3.testing."""

from __future__ import annotations

import json

import pytest

from eagle3.config import EvaluateConfig
from eagle3.evaluate import EvaluateResult, run_evaluate, simulate_acceptance_length
from eagle3.testing.random_draft import build_random_draft

K = 3


def test_simulate_acceptance_length():
    assert simulate_acceptance_length([]) == 1.0
    assert simulate_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulate_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulate_acceptance_length([0.0, 0.9]) == 1.0
    with pytest.raises(ValueError, match=r"per_step_acc\[1\]"):
        simulate_acceptance_length([0.5, 1.5])


def test_random_draft_layout(tiny_llama, tmp_path):
    from safetensors import safe_open

    d = build_random_draft(tiny_llama, tmp_path / "draft", draft_vocab_size=300, aux_layer_ids=[1, 2, 4])
    cfg = json.loads((d.path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 300
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    with safe_open(str(d.path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").shape == (d.hidden_size, 3 * d.hidden_size)
        assert f.get_tensor("lm_head.weight").shape == (300, d.hidden_size)
        assert f.get_tensor("d2t").shape == (300,) and f.get_tensor("t2d").sum() == 300
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * d.hidden_size
    with pytest.raises(ValueError, match="duplicates"):
        build_random_draft(tiny_llama, tmp_path / "bad", aux_layer_ids=[2, 2, 2])


def test_evaluate_random_draft(tiny_llama, tmp_path):
    from pathlib import Path

    draft = build_random_draft(tiny_llama, tmp_path / "draft", draft_vocab_size=256, aux_layer_ids=[1, 2, 4])
    prompts = Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets" / "demo_eval_prompts.jsonl"
    cfg = EvaluateConfig(
        target=str(tiny_llama), draft=str(draft.path), prompts=str(prompts), out=tmp_path / "eval",
        num_prompts=8, num_speculative_tokens=K, max_tokens=24, max_model_len=256, dtype="float32", baseline=True,
    )
    res = run_evaluate(cfg)
    assert isinstance(res, EvaluateResult)
    assert res.num_prompts == 8
    assert res.num_drafts > 0 and res.acceptance_length >= 1.0
    assert len(res.accepted_per_position) == K and len(res.acceptance_rate_per_position) == K
    assert res.num_draft_tokens == K * res.num_drafts
    assert res.acceptance_length == pytest.approx(1 + res.num_accepted_tokens / res.num_drafts, abs=1e-3)
    assert sum(res.accepted_per_position) == res.num_accepted_tokens
    assert res.spec_tokens_per_s > 0 and res.baseline_tokens_per_s > 0 and res.speedup > 0
    assert res.outputs_match_baseline is not None
    data = json.loads(res.results_path.read_text())
    assert data["acceptance_length"] == res.acceptance_length
    assert data["engine"]["speculative_config"]["method"] == "eagle3"
    assert data["baseline_run"]["speculative"] is False
    assert res.chart_path.read_bytes()[:4] == b"\x89PNG"


def test_evaluate_errors(tiny_llama, tmp_path):
    from eagle3.config import ConfigError

    with pytest.raises(ConfigError, match="--draft"):
        run_evaluate(EvaluateConfig(target=str(tiny_llama), prompts="x.jsonl", out=tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        run_evaluate(EvaluateConfig(target=str(tiny_llama), draft=str(tmp_path), prompts="x.jsonl", out=tmp_path))
