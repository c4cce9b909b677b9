"""The published chat templates of thinking models on tiny targets of their families: each
template's own rules for a conversation's history (what the real model reads back of its earlier
turns), thinking on and off, on a tokenizer whose `<think>` / `</think>` / end-of-turn tokens are
the real model's; and the thinking emitter that makes a tiny target write reasoning + answer
turns."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from tests.thinking_templates import CHAT_TEMPLATES, TEMPLATE_FILES, template_path
from transformers import AutoTokenizer

from eagle3.testing.tiny import (
    THINKING_FAMILIES,
    build_tiny_thinking_target,
    build_tiny_thinking_tokenizer,
    make_thinking_emitter,
    thinking_kwargs,
)

FAMILIES = list(THINKING_FAMILIES)
#: the families whose reasoning markers are one token each (the thinking emitter writes them)
ONE_TOKEN_MARKERS = [f for f in FAMILIES if f not in ("kimi-k3", "deepseek-r1-split-think")]

#: two turns, each with its reasoning as an OpenAI-compatible server returns it
CONVERSATION = [
    {"role": "user", "content": "Name two colours."},
    {
        "role": "assistant",
        "content": "Red and blue.",
        "reasoning_content": "The user wants two colours.",
    },
    {"role": "user", "content": "And one more?"},
    {"role": "assistant", "content": "Green.", "reasoning_content": "One more colour."},
]
REASONING = [m["reasoning_content"] for m in CONVERSATION if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> its tiny tokenizer, loaded back from disk as the pipeline loads a target's."""
    root = tmp_path_factory.mktemp("thinking_tokenizers")
    for family in FAMILIES:
        build_tiny_thinking_tokenizer(root / family, family, template_path(family))
    return {family: AutoTokenizer.from_pretrained(str(root / family)) for family in FAMILIES}


def render(tok, messages, family, thinking, generation_prompt=False) -> str:
    return tok.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **thinking_kwargs(family, thinking),
    )


def emitted(family: str, thinking: bool, reasoning: str, answer: str) -> str:
    """What the real model writes for a turn after its generation prompt, end of turn included."""
    fam = THINKING_FAMILIES[family]
    if family == "qwen3":
        block = f"<think>\n{reasoning}\n</think>\n\n" if thinking else ""
    elif family == "kimi-k2-thinking":
        block = f"<think>{reasoning}</think>"
    elif family == "deepseek-r1-distill":  # the prompt pre-fills "<think>\n"
        block = f"{reasoning}\n</think>\n\n"
    else:  # deepseek-v3.1: the prompt pre-fills "<think>" (thinking) or "</think>"
        block = f"{reasoning}</think>" if thinking else ""
    return block + answer + fam.eos_token


def test_every_family_has_its_published_template_stored_as_sources_records_it():
    sources = (CHAT_TEMPLATES / "SOURCES.md").read_text()
    recorded = dict(re.findall(r"^\| `([^`]+\.jinja)` \|.*\| `([0-9a-f]{64})` \|$", sources, re.M))
    assert set(TEMPLATE_FILES) == set(THINKING_FAMILIES)
    assert (
        set(recorded)
        == set(TEMPLATE_FILES.values())
        == {p.name for p in CHAT_TEMPLATES.glob("*.jinja")}
    )
    for name, sha in recorded.items():
        data = (CHAT_TEMPLATES / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, f"{name} differs from the published file"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_has_the_families_tokens_and_the_template_byte_for_byte(tokenizers, family):
    tok, fam = tokenizers[family], THINKING_FAMILIES[family]
    installed = Path(tok.name_or_path) / "chat_template.jinja"
    assert installed.read_bytes() == template_path(family).read_bytes()
    assert tok.chat_template == template_path(family).read_text(encoding="utf-8")
    assert tok.eos_token == fam.eos_token and tok.bos_token == fam.bos_token
    for text in (fam.eos_token, fam.turn_end, *fam.special_tokens, *fam.plain_tokens):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == 1, text
    assert tok(fam.eos_token, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]
    for marker in fam.think_markers:  # one token each, or several where the family splits them
        pieces = tok(marker, add_special_tokens=False)["input_ids"]
        assert (len(pieces) == 1) == (family in ONE_TOKEN_MARKERS), (marker, pieces)


@pytest.mark.parametrize("family", ONE_TOKEN_MARKERS)
def test_think_tokens_are_stripped_by_decoding_only_where_the_real_model_marks_them_special(
    tokenizers, family
):
    tok, (start_text, end_text) = tokenizers[family], THINKING_FAMILIES[family].think_markers
    text = f"{start_text}a thought{end_text}the answer"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start, end = tok.convert_tokens_to_ids([start_text, end_text])
    assert ids[0] == start and end in ids
    decoded = tok.decode(ids, skip_special_tokens=True)
    if THINKING_FAMILIES[family].think_tokens_special:  # Kimi's and Seed's tokenizers
        assert decoded == "a thoughtthe answer"
    else:  # Qwen3, DeepSeek, GLM and MiniMax add <think> / </think> as plain tokens
        assert decoded == text


#: the text each template writes between a turn's answer and the token that ends it
ANSWER_CLOSE = {"kimi-k3": "<|close|>response<|sep|><|close|>message<|sep|>"}


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_assistant_turn_ends_with_the_end_of_turn_token(tokenizers, family, thinking):
    """The token after a history turn's answer (and its closing tags) is the family's end of
    turn, one token; the conversation opens with the bos where the template writes one."""
    tok, fam = tokenizers[family], THINKING_FAMILIES[family]
    history = [*CONVERSATION, {"role": "user", "content": "Thanks."}]
    ids = tok(render(tok, history, family, thinking), add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids(fam.turn_end)
    for answer in ("Red and blue.", "Green."):
        answer_ids = tok(answer + ANSWER_CLOSE.get(family, ""), add_special_tokens=False)
        answer_ids = answer_ids["input_ids"]
        at = next(i for i in range(len(ids)) if ids[i : i + len(answer_ids)] == answer_ids)
        assert ids[at + len(answer_ids)] == end, family
    writes_bos = family.startswith("deepseek") or family in ("minimax-m2", "seed-oss")
    assert (ids[0] == tok.bos_token_id) == writes_bos, fam.bos_token


def test_kimi_k2_thinking_renders_history_turns_as_an_empty_think_block(tokenizers):
    tok = tokenizers["kimi-k2-thinking"]
    full = render(tok, CONVERSATION, "kimi-k2-thinking", True)
    assert full == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|><|im_user|>user<|im_middle|>Name two colours.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Red and blue.<|im_end|>"
        "<|im_user|>user<|im_middle|>And one more?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Green.<|im_end|>"
    )
    prompt = render(tok, CONVERSATION[:3], "kimi-k2-thinking", True, generation_prompt=True)
    assert prompt.endswith(
        "<|im_user|>user<|im_middle|>And one more?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )  # the model opens <think>
    assert not any(r in full + prompt for r in REASONING)
    # the reasoning of the turns after the last plain answer (a tool-call chain) is kept
    call = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look it up.",
        "tool_calls": [
            {
                "id": "functions.find:0",
                "type": "function",
                "function": {"name": "find", "arguments": "{}"},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "functions.find:0", "content": "green"}
    chain = render(tok, [*CONVERSATION[:3], call, result], "kimi-k2-thinking", True, True)
    assert "<|im_middle|><think>Look it up.</think><|tool_calls_section_begin|>" in chain


def test_qwen3_keeps_the_reasoning_of_turns_after_the_last_user_query(tokenizers):
    tok = tokenizers["qwen3"]
    on, off = (render(tok, CONVERSATION, "qwen3", t) for t in (True, False))
    assert (
        on
        == off
        == (
            "<|im_start|>user\nName two colours.<|im_end|>\n"
            "<|im_start|>assistant\nRed and blue.<|im_end|>\n"
            "<|im_start|>user\nAnd one more?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nOne more colour.\n</think>\n\nGreen.<|im_end|>\n"
        )
    )
    prompt_on = render(tok, CONVERSATION[:3], "qwen3", True, generation_prompt=True)
    prompt_off = render(tok, CONVERSATION[:3], "qwen3", False, generation_prompt=True)
    assert prompt_on.endswith("<|im_start|>assistant\n")  # the model opens <think>
    assert prompt_off == prompt_on + "<think>\n\n</think>\n\n"


def test_deepseek_r1_distill_drops_reasoning_from_history_and_prefills_think(tokenizers):
    tok = tokenizers["deepseek-r1-distill"]
    full = render(tok, CONVERSATION, "deepseek-r1-distill", True)
    assert full == (
        "<｜begin▁of▁sentence｜><｜User｜>Name two colours.<｜Assistant｜>Red and blue."
        "<｜end▁of▁sentence｜><｜User｜>And one more?<｜Assistant｜>Green.<｜end▁of▁sentence｜>"
    )
    inline = [CONVERSATION[0], {"role": "assistant", "content": "<think>\nhm\n</think>\n\nRed."}]
    assert render(tok, inline, "deepseek-r1-distill", True).endswith(
        "<｜Assistant｜>\n\nRed.<｜end▁of▁sentence｜>"
    )  # an inline block is cut at </think>
    prompt = render(tok, CONVERSATION[:3], "deepseek-r1-distill", True, generation_prompt=True)
    assert prompt.endswith("<｜User｜>And one more?<｜Assistant｜><think>\n")


def test_deepseek_v3_1_thinking_switch_changes_only_the_generation_prompt(tokenizers):
    tok = tokenizers["deepseek-v3.1"]
    on, off = (render(tok, CONVERSATION, "deepseek-v3.1", t) for t in (True, False))
    assert (
        on
        == off
        == (
            "<｜begin▁of▁sentence｜><｜User｜>Name two colours.<｜Assistant｜></think>Red and blue."
            "<｜end▁of▁sentence｜><｜User｜>And one more?<｜Assistant｜></think>Green."
            "<｜end▁of▁sentence｜>"
        )
    )
    head = "<｜User｜>And one more?<｜Assistant｜>"
    for thinking, opener in ((True, "<think>"), (False, "</think>")):
        prompt = render(tok, CONVERSATION[:3], "deepseek-v3.1", thinking, generation_prompt=True)
        assert prompt.endswith(head + opener)
    default = tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True)
    assert default.endswith(head + "</think>")  # no kwarg: thinking off


#: whether a turn, as the model writes it after its prompt, is where the next prompt's history
#: reads it back (prefix-stable) — per family and turn, thinking on
AS_GENERATED_IN_HISTORY = {
    "kimi-k2-thinking": (False, False),  # history: <think></think> + answer, even the last turn
    "qwen3": (False, True),  # reasoning kept after the last user query only
    "deepseek-r1-distill": (False, False),  # reasoning dropped
    "deepseek-v3.1": (False, False),  # history: </think> + answer
}


@pytest.mark.parametrize("family", list(AS_GENERATED_IN_HISTORY))
def test_a_generated_turn_is_not_what_the_history_reads_back(tokenizers, family):
    tok = tokenizers[family]
    full = render(tok, CONVERSATION, family, True)
    for turn, stable in enumerate(AS_GENERATED_IN_HISTORY[family]):
        prompt = render(tok, CONVERSATION[: 2 * turn + 1], family, True, generation_prompt=True)
        answer = CONVERSATION[2 * turn + 1]["content"]
        written = prompt + emitted(family, True, REASONING[turn], answer)
        assert full.startswith(written) == stable, (family, turn)


@pytest.mark.parametrize(
    "family",
    [  # transformers runs DeepSeek-V3's experts one by one: ~10 s per target on 2 cores
        pytest.param(f, marks=pytest.mark.slow) if THINKING_FAMILIES[f].arch == "deepseek_v3" else f
        for f in ONE_TOKEN_MARKERS
    ],
)
def test_a_thinking_emitter_writes_reasoning_then_answer_then_the_eos(thinking_target, family):
    import torch

    from eagle3.hf import load_causal_lm

    path = thinking_target(family)
    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = load_causal_lm(path, dtype=torch.float32)
    end = tok.convert_tokens_to_ids(THINKING_FAMILIES[family].think_markers[1])
    turn_end = tok.convert_tokens_to_ids(THINKING_FAMILIES[family].turn_end)
    users = [
        "Name two colours.",
        "What is the time?",
        "Tell me a story.",
        "Why is the sea blue?",
        "Write a list.",
        "Count to five.",
        "Say something kind.",
        "Where is home?",
    ]
    for thinking in (True, False) if THINKING_FAMILIES[family].thinking_kwarg else (True,):
        prompts = [
            render(tok, [{"role": "user", "content": u}], family, thinking, True) for u in users
        ]
        batch = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id
            )
        turns = [row[batch["input_ids"].shape[1] :].tolist() for row in out]
        ended = [t[: t.index(turn_end)] for t in turns if turn_end in t]
        assert len(ended) >= 6, (family, thinking, [tok.decode(t) for t in turns])
        closed = [t for t in ended if t.count(end) == 1]
        if thinking:
            assert len(closed) >= 6, (family, [tok.decode(t) for t in turns])
        else:
            assert not closed, (family, [tok.decode(t) for t in turns])


def test_the_emitter_refuses_other_targets_and_rewrites_once(tmp_path):
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    plain = build_tiny_target(tmp_path / "plain", TinySpec(num_layers=1))
    with pytest.raises(ValueError, match="not a tiny thinking target"):
        make_thinking_emitter(plain)
    spec = TinySpec(arch="llama", num_layers=1, vocab_size=1024)
    emitter = make_thinking_emitter(
        build_tiny_thinking_target(tmp_path / "qwen3", "qwen3", template_path("qwen3"), spec)
    )
    weights = (emitter / "model.safetensors").read_bytes()
    assert make_thinking_emitter(emitter) == emitter  # the same settings: nothing to do
    assert (emitter / "model.safetensors").read_bytes() == weights
    with pytest.raises(ValueError, match="already emits"):
        make_thinking_emitter(emitter, think_close_share=0.2)
    rebuilt = build_tiny_thinking_target(emitter, "qwen3", template_path("qwen3"), spec)
    assert "thinking_emitter" not in (rebuilt / "tiny_spec.json").read_text()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_turn_reasoning_is_checked_only_where_the_template_renders_it(tmp_path, family):
    """A text turn's reasoning counts as checked only where the template renders the last turn's
    reasoning, even when its words also occur in the user's turn: a trace as short as one word is
    no sign that the template rendered it. Elsewhere it is placed between the learned markers."""
    from eagle3.chat_template import ChatRenderer
    from eagle3.data.prepare import conversation_rows

    build_tiny_thinking_tokenizer(tmp_path / family, family, template_path(family))
    renderer = ChatRenderer(tmp_path / family, chat_template_kwargs=thinking_kwargs(family, True))
    messages = [
        {"role": "user", "content": "The house has a door."},
        {"role": "assistant", "content": " door", "reasoning": " has"},
    ]
    renders = family in ("qwen3", "kimi-k3", "glm-4.6", "minimax-m2", "seed-oss")
    turn = renderer.text_turn(messages)
    assert turn.reasoning_checked == renders and not turn.reasoning_dropped
    prompt = renderer.prompt_ids(messages[:1])
    ((ids, mask),) = conversation_rows(renderer, messages)
    assert ids == prompt + turn.completion_ids and sum(mask) == len(turn.completion_ids)
    text = renderer.decode(turn.completion_ids)
    assert text.count("has") == 1 and text.count("door") == 1
