"""Thinking targets end to end, token-exact: the published chat templates of Kimi-K2-Thinking,
Qwen3, DeepSeek-R1-distill and DeepSeek-V3.1 on tiny targets of their families that write
reasoning + answer turns (eagle3.testing.tiny.make_thinking_emitter), thinking on and off, two-turn
chats.

For each: regenerate -> prepare -> capture -> train, and the trained ids of every assistant turn are
exactly the ids the target generated; the same chats as text only (what a user's own dataset holds:
`reasoning_content` + content) prepare to the same ids through the alignment check. The matrix
generates with transformers (hf backend); tests/test_regenerate.py and tests/test_openai_server.py
show the same for vLLM's engine and server, and the last test runs one family through vLLM's
capture and evaluate, with acceptance on the reasoning and the answer spans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.chat_formats import read_conversations
from eagle3.config import PipelineConfig, PrepareConfig
from eagle3.data.prepare import run_prepare
from eagle3.prepared import supervised_ids_by_conversation
from eagle3.testing.tiny import thinking_kwargs

#: (family, thinking): the templates without a switch always think
CASES = [
    ("kimi-k2-thinking", True),
    ("qwen3", True),
    ("qwen3", False),
    ("deepseek-r1-distill", True),
    ("deepseek-v3.1", True),
    ("deepseek-v3.1", False),
    ("glm-4.6", True),
    ("glm-4.6", False),
    ("minimax-m2", True),
    ("seed-oss", True),
    ("seed-oss", False),
]
#: the templates that render a text turn as the tiny target writes it; the others add whitespace
#: of their own around the reasoning and the answer (Qwen3's "<think>\n", GLM's "\n" before the
#: answer, Seed-OSS's trim), which the real models write and the tiny targets do not
TEXT_AS_GENERATED = {
    ("kimi-k2-thinking", True),
    ("qwen3", False),
    ("deepseek-r1-distill", True),
    ("deepseek-v3.1", True),
    ("deepseek-v3.1", False),
}

QUESTIONS = [
    "Name two colours of the sea.",
    "What do you call a small house by a river?",
    "Which animal sleeps in the day?",
    "Tell me the name of a warm country.",
    "How many legs has a spider?",
    "Where does the sun go at night?",
]


def two_turn_chats() -> list[dict]:
    return [
        {
            "id": f"chat-{i}",
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": "an answer the target will replace"},
                {"role": "user", "content": "And why is that so?"},
            ],
        }
        for i, q in enumerate(QUESTIONS)
    ]


def pipeline(target: Path, work: Path, family: str, thinking: bool, **over) -> PipelineConfig:
    data = work.parent / f"{work.name}-chats.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in two_turn_chats()))
    cfg = {
        "name": f"thinking-{family}",
        "target": str(target),
        "data": str(data),
        "work_dir": str(work),
        "chat_template_kwargs": thinking_kwargs(family, thinking),
        "regenerate": {
            "backend": "hf",
            "device": "cpu",
            "dtype": "float32",
            "max_new_tokens": 96,
            "max_model_len": 512,
            "batch_size": 8,
        },
        "prepare": {"max_seq_len": 512},
        "capture": {
            "backend": "hf",
            "device": "cpu",
            "dtype": "float32",
            "batch_tokens": 1024,
            "aux_layer_ids": [1],  # the tiny targets have 2 layers
        },
        "vocab": {"draft_vocab_size": 128},
        "train": {
            "epochs": 1,
            "device": "cpu",
            "loader": {"max_seq_len": 512, "val_fraction": 0.2},
            "loss": {"ttt_steps": 2},
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"eval_every": 1000, "save_every": 1000},
        },
    }
    for section, values in over.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return PipelineConfig.model_validate(cfg)


def generated_ids(conversations_path: Path) -> dict[str, list[int]]:
    """sample id -> the ids of its assistant turns, in order, as the target generated them."""
    out: dict[str, list[int]] = {}
    for c in read_conversations(conversations_path).conversations:
        for m in c.messages:
            if m["role"] == "assistant":
                out.setdefault(c.sample_id, []).extend(m["token_ids"])
    return out


def as_text_only(conversations_path: Path, out: Path) -> Path:
    """The regenerated chats as a user's own dataset holds them: reasoning_content + content, no
    ids."""
    rows = []
    for line in conversations_path.read_text().splitlines():
        row = json.loads(line)
        for m in row["messages"]:
            for key in ("token_ids", "prompt_token_ids", "finish_reason"):
                m.pop(key, None)
            if "reasoning" in m:
                m["reasoning_content"] = m.pop("reasoning")
        rows.append(row)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.mark.parametrize(("family", "thinking"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_trained_ids_are_the_generated_ids(thinking_target, tmp_path, family, thinking):
    from eagle3.pipeline import run_pipeline

    target = thinking_target(family)
    cfg = pipeline(target, tmp_path / "work", family, thinking)
    res = run_pipeline(cfg)
    assert list(res.stages)[:6] == ["regenerate", "prepare", "capture", "vocab", "train", "export"]
    regen, prep = res.stages["regenerate"], res.stages["prepare"]
    # every turn of every chat was regenerated: two per chat
    assert regen.num_turns == 2 * len(QUESTIONS)
    generated = generated_ids(regen.conversations_path)
    assert supervised_ids_by_conversation(tmp_path / "work" / "prepared") == generated
    assert prep.turns["from_generated"] == regen.num_turns and not prep.turns.get("from_text")
    if thinking:  # regenerate stored each turn's reasoning apart from its answer
        apart, with_block = kept_apart(regen.conversations_path)
        assert (
            apart >= regen.num_turns // 2 and with_block >= apart
        )  # most turns think; the reasoning is trained, `<think>` / `</think>` included
        assert prep.turns["with_reasoning"] >= regen.num_turns // 2
        assert prep.turns["reasoning_tokens"] > 0
    else:
        assert not prep.turns.get("reasoning_tokens")
    # the capture and the draft cover exactly those rows
    assert res.stages["capture"].num_samples == prep.num_samples
    assert res.stages["train"].steps > 0

    # the same chats as text only (reasoning_content + content, no ids): each turn is tokenized
    # as the target writes it and held against the template's rendering of that turn
    text = as_text_only(regen.conversations_path, tmp_path / "text.jsonl")
    prep_cfg = PrepareConfig(
        target=str(target),
        data=str(text),
        out=tmp_path / "from-text",
        max_seq_len=512,
        chat_template_kwargs=thinking_kwargs(family, thinking),
    )
    from_text = run_prepare(prep_cfg)
    assert from_text.turns["from_text"] == regen.num_turns
    if (family, thinking) in TEXT_AS_GENERATED:
        assert supervised_ids_by_conversation(tmp_path / "from-text") == generated
    elif thinking:
        assert from_text.turns["reasoning_tokens"] > 0
    if thinking and family in ("kimi-k2-thinking", "deepseek-r1-distill", "deepseek-v3.1"):
        assert from_text.turns["reasoning_unchecked"] > 0  # these render no last-turn reasoning
    else:
        assert not from_text.turns.get("reasoning_unchecked")


def kept_apart(conversations_path: Path) -> tuple[int, int]:
    """(turns whose reasoning and answer came back apart, turns with a think block): the thinking
    emitter writes reasoning words a-m and answer words n-z, so every stored reasoning word is a-m
    and every answer word n-z."""
    apart = with_block = 0
    for c in read_conversations(conversations_path).conversations:
        for m in c.messages:
            if m["role"] != "assistant" or m.get("reasoning") is None:
                continue
            with_block += 1
            reasoning, answer = m["reasoning"].split(), m["content"].split()
            if m.get("finish_reason") == "stop" and reasoning and answer:
                assert all(w[0] < "n" for w in reasoning), m
                assert all(w[0] >= "n" for w in answer), m
                apart += 1
    return apart, with_block


@pytest.mark.parametrize(
    "family",
    [  # GLM's and Seed-OSS's text turns are also prepared in the matrix above
        "kimi-k3",
        "deepseek-r1-split-think",
        pytest.param("glm-4.6", marks=pytest.mark.slow),
        pytest.param("seed-oss", marks=pytest.mark.slow),
    ],
)
def test_text_chats_through_every_stage(thinking_target_untrained, tmp_path, family):
    """Chats brought as text, reasoning in `reasoning_content`, through prepare, capture, train
    and export on a tiny target of the family (random weights: the stages after prepare need no
    target that thinks), thinking on: every turn's reasoning is trained."""
    from eagle3.pipeline import run_pipeline

    target = thinking_target_untrained(family)
    cfg = pipeline(target, tmp_path / "work", family, True, regenerate={"enabled": False})
    rows = []
    for i, q in enumerate(QUESTIONS[:4]):
        rows.append(
            {
                "id": f"chat-{i}",
                "messages": [
                    {"role": "user", "content": q},
                    {
                        "role": "assistant",
                        "content": "Short answer.",
                        "reasoning_content": "A thought.",
                    },
                ],
            }
        )
    Path(cfg.data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_pipeline(cfg)
    assert "regenerate" not in res.stages
    prep = res.stages["prepare"]
    assert prep.turns["from_text"] == 4 and prep.turns["with_reasoning"] == 4
    assert res.stages["capture"].num_samples == prep.num_samples
    assert res.stages["train"].steps > 0 and "export" in res.stages


@pytest.mark.parametrize("family", ["kimi-k3", "deepseek-r1-split-think"])
def test_regenerated_turns_of_several_token_markers_through_every_stage(
    thinking_target_untrained, tmp_path, family
):
    """Templates whose markers are several tokens (Kimi-K3's `<|open|>think<|sep|>`, `<think>` in
    pieces), thinking on: the generation prompt opens the block, the tiny target (random weights:
    the thinking emitter writes one token per marker) writes what it writes, and every stage
    follows: the trained ids are the generated ids, and each stored turn's text is reasoning up to
    the closing marker it wrote, never merged into the answer."""
    from eagle3.chat_template import ChatRenderer
    from eagle3.pipeline import run_pipeline

    target = thinking_target_untrained(family)
    cfg = pipeline(
        target,
        tmp_path / "work",
        family,
        True,
        regenerate={"max_new_tokens": 12, "temperature": 1.0},
    )
    res = run_pipeline(cfg)
    regen, prep = res.stages["regenerate"], res.stages["prepare"]
    generated = generated_ids(regen.conversations_path)
    assert supervised_ids_by_conversation(tmp_path / "work" / "prepared") == generated
    renderer = ChatRenderer(target, chat_template_kwargs=thinking_kwargs(family, True))
    close = renderer.think_markers[1]
    for c in read_conversations(regen.conversations_path).conversations:
        for m in (m for m in c.messages if m["role"] == "assistant"):
            text = renderer.decode(m["token_ids"])
            if close not in text:  # the block the prompt opened never closed: all reasoning
                assert m["reasoning"] is not None and m["content"] == "", m
    assert prep.turns["reasoning_tokens"] > 0
    assert res.stages["train"].steps > 0 and "export" in res.stages


@pytest.mark.vllm
@pytest.mark.slow
def test_thinking_target_through_vllm_with_acceptance_per_span(thinking_target, tmp_path):
    """Qwen3's template, thinking on, through vLLM: the engine's generated ids are what prepare
    trains, the capture and the draft follow, and evaluate measures the draft and n-gram on the
    reasoning span and on the answer span apart (results.json `span_rows`, results.md's table, the
    stage line)."""
    from eagle3.artifacts import EvalResults
    from eagle3.console import key_figure
    from eagle3.pipeline import run_pipeline

    target = thinking_target("qwen3")
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"e{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS))
    )
    cfg = pipeline(
        target,
        tmp_path / "work",
        "qwen3",
        True,
        eval_prompts=str(prompts),
        regenerate={"backend": "vllm"},
        capture={"backend": "vllm", "dtype": "auto"},
        train={"epochs": 3},
        evaluate={
            "num_prompts": len(QUESTIONS),
            "max_tokens": 48,
            "max_model_len": 512,
            "compare": ["ngram"],
        },
    )
    res = run_pipeline(cfg)
    regen = res.stages["regenerate"]
    assert supervised_ids_by_conversation(tmp_path / "work" / "prepared") == generated_ids(
        regen.conversations_path
    )
    results = EvalResults.load(tmp_path / "work" / "evaluate")
    assert results.chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert results.chat["draft_chat_template_kwargs"] == {"enable_thinking": True}
    spans = {(r.method, r.span): r for r in results.span_rows if r.category == "all"}
    assert set(spans) == {(m, s) for m in ("eagle3", "ngram") for s in ("reasoning", "answer")}
    for row in spans.values():
        assert row.generated_tokens > 0 and row.tokens_per_step >= 1.0
    # the spans add up to the whole: every generated token is in one of them
    whole = next(r for r in results.rows if r.category == "all")
    assert whole.generated_tokens == sum(
        spans[("eagle3", s)].generated_tokens for s in ("reasoning", "answer")
    )
    table = (tmp_path / "work" / "evaluate" / "results.md").read_text()
    assert "| 0 | reasoning |" in table and "| 0 | answer |" in table
    line = key_figure("evaluate", res.stages["evaluate"])
    assert "reasoning " in line and "answer " in line
