"""Reasoning as data: what the readers keep of a turn's reasoning, regeneration that records cut
traces, the one trust_remote_code switch, and the one chat_template_kwargs switch (no vLLM: the hf
backend generates)."""

from __future__ import annotations

import json

import pytest
from tests.remote_code import remote_code_target

from eagle3.chat_formats import read_conversations
from eagle3.config import (
    ConfigError,
    PipelineConfig,
    PrepareConfig,
    RegenerateConfig,
    load_pipeline_config,
)
from eagle3.data.regenerate import run_regenerate


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reader_keeps_reasoning_from_every_field_a_server_writes(tmp_path):
    """`reasoning_content` (older vLLM, DeepSeek's API), `reasoning` (newer vLLM) and an inline
    think block are kept per turn, to the character, and counted; nothing vanishes."""
    rows = [
        {
            "id": "field",
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "two and two\n"},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6", "reasoning": "three and three"},
            ],
        },
        {
            "id": "inline",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello!"},
            ],
        },
        {
            "id": "r1-style",  # the template pre-filled <think>: the text starts inside it
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "greet back</think>Hi."},
            ],
        },
        {"id": "plain", "question": "q", "answer": "a"},
    ]
    read = read_conversations(_write_jsonl(tmp_path / "d.jsonl", rows))
    by_id = {c.sample_id: c.messages for c in read.conversations}
    assert by_id["field"][1]["reasoning"] == "two and two\n"
    assert by_id["field"][3]["reasoning"] == "three and three"
    assert (by_id["inline"][1]["reasoning"], by_id["inline"][1]["content"]) == (
        "\nsay hello\n",
        "\n\nHello!",
    )
    assert (by_id["r1-style"][1]["reasoning"], by_id["r1-style"][1]["content"]) == (
        "greet back",
        "Hi.",
    )
    assert "reasoning" not in by_id["plain"][1]
    assert read.turns == {"reasoning_field": 2, "inline_think": 2, "text_only": 1}
    assert read.summary()["assistant_turns"] == dict(read.turns)


def test_reader_refuses_bad_token_ids_by_row(tmp_path):
    rows = [
        {
            "id": "bad",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x", "token_ids": [1, "two"]},
            ],
        },
        {"id": "ok", "question": "q", "answer": "a"},
    ]
    read = read_conversations(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert read.skipped == {"bad_token_ids": 1}
    assert (
        "messages[1].token_ids must be a list of token ids"
        in read.skip_examples["bad_token_ids"][0]
    )


def test_chat_template_kwargs_from_the_command_line_and_the_pipeline(tmp_path):
    assert RegenerateConfig(chat_template_kwargs='{"thinking": true}').chat_template_kwargs == {
        "thinking": True
    }
    assert PrepareConfig(chat_template_kwargs="enable_thinking=false").chat_template_kwargs == {
        "enable_thinking": False
    }
    with pytest.raises(ValueError, match="enable_thinking=false"):
        PrepareConfig(chat_template_kwargs="enable_thinking")
    pipe = PipelineConfig(
        target="t", data="d", chat_template_kwargs={"thinking": False}, trust_remote_code=True
    ).resolved()
    for section in (pipe.regenerate, pipe.prepare, pipe.refine, pipe.evaluate):
        assert section.chat_template_kwargs == {"thinking": False}
    # every stage that loads the target's tokenizer, config or model code
    for section in (pipe.synthesize, pipe.regenerate, pipe.prepare, pipe.capture, pipe.refine):
        assert section.trust_remote_code is True
    assert pipe.evaluate.trust_remote_code is True
    # a section's own setting wins over the top-level one
    yaml = tmp_path / "p.yaml"
    yaml.write_text(
        "target: t\ndata: d\nchat_template_kwargs: {thinking: true}\n"
        "evaluate:\n  chat_template_kwargs: {thinking: false}\n"
    )
    resolved = load_pipeline_config(yaml).resolved()
    assert resolved.prepare.chat_template_kwargs == {"thinking": True}
    assert resolved.evaluate.chat_template_kwargs == {"thinking": False}


def _regen(target, data, out, **kw) -> RegenerateConfig:
    values = dict(
        target=str(target),
        data=str(data),
        out=out,
        backend="hf",
        device="cpu",
        dtype="float32",
        max_new_tokens=6,
        max_model_len=256,
        batch_size=4,
    )
    return RegenerateConfig(**{**values, **kw})


def test_regenerate_honours_trust_remote_code(tiny_llama, tmp_path):
    """regenerate loads the target's tokenizer as prepare does: its own code runs only with
    trust_remote_code, and the error names the key to set."""
    target = remote_code_target(tiny_llama, tmp_path)
    data = _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "question": "What is two?"}])
    with pytest.raises(ConfigError, match=r"TinyRemoteTokenizer.*trust_remote_code: true"):
        run_regenerate(_regen(target, data, tmp_path / "refused"))
    res = run_regenerate(_regen(target, data, tmp_path / "r", trust_remote_code=True))
    assert res.num_written == 1
    assert res.manifest["chat"]["trust_remote_code"] is True


def test_regenerate_reports_and_can_drop_cut_turns(tiny_llama, tmp_path):
    """A turn that hits max_new_tokens (a cut trace) is counted per source as a share, shown in
    the stage's line; drop_truncated leaves such turns out, counted."""
    from eagle3.console import key_figure

    rows = [{"id": f"q{i}", "question": f"Tell me about number {i}."} for i in range(6)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    kept = run_regenerate(_regen(tiny_llama, data, tmp_path / "kept", max_new_tokens=3))
    share = kept.truncated_share[str(data)]
    assert 0 < share <= 1
    assert kept.manifest["truncated_share"] == {str(data): share}
    assert f"{share:.0%} cut at max_new_tokens" in key_figure("regenerate", kept)
    dropped = run_regenerate(
        _regen(tiny_llama, data, tmp_path / "dropped", max_new_tokens=3, drop_truncated=True)
    )
    num_cut = round(share * 6)
    assert dropped.skipped.get("hit_max_new_tokens") == num_cut
    assert dropped.num_written == kept.num_written - num_cut


def test_evaluate_line_names_each_span_from_the_stage_result():
    """The stage line of evaluate, from the result the stage returns in process (rows as
    records): tokens per target step overall, then on the reasoning and the answer spans."""
    from pathlib import Path

    from eagle3.console import key_figure
    from eagle3.evaluate import CategoryResult, EvaluateResult

    def row(span: str, generated: int, accepted: int) -> CategoryResult:
        return CategoryResult(
            method="eagle3",
            category="all",
            temperature=0.0,
            num_prompts=2,
            tau=1.5,
            num_drafts=4,
            num_accepted_tokens=accepted,
            accepted_per_position=[accepted, 0, 0],
            generated_tokens=generated,
            tokens_per_s=10.0,
            tokens_per_step=generated / (generated - accepted),
            span=span,
        )

    result = EvaluateResult(
        out=Path("out"),
        results_path=Path("out/results.json"),
        chart_path=None,
        num_prompts=2,
        num_speculative_tokens=3,
        acceptance_length=1.5,
        num_drafts=8,
        num_draft_tokens=24,
        num_accepted_tokens=6,
        accepted_per_position=[6, 0, 0],
        acceptance_rate_per_position=[0.75, 0.0, 0.0],
        spec_tokens_per_s=10.0,
        rows=[row("all", 30, 6)],
        span_rows=[row("reasoning", 20, 5), row("answer", 10, 1)],
    )
    line = key_figure("evaluate", result)
    assert line.startswith("τ 1.50, 1.25 tokens/target step")
    assert "reasoning 1.33" in line and "answer 1.11" in line
