"""Every family's reasoning format, read from its published chat template: the markers (one token
or several) agree with the family's vLLM reasoning parser; chats brought as text, with their
reasoning as `reasoning_content`, as `reasoning` or inline in the family's own markers, supervise
each reasoning and each answer exactly once, after the template's own generation prompt, with no
doubled think block; a generated turn splits back into its reasoning and its answer, which the next
prompt renders through the template's reasoning field; and what cannot be represented is refused
with the row, the turn and the first difference. Tokenizers only (no model)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tests.thinking_templates import template_path
from transformers import AutoTokenizer

from eagle3.chat_formats import read_conversations
from eagle3.chat_template import ChatRenderer, MisalignedTurnError, TemplateError
from eagle3.config import TEMPLATE_KWARGS_HELP, PrepareConfig, parse_template_kwargs
from eagle3.data.prepare import conversation_turns, run_prepare
from eagle3.testing.tiny import THINKING_FAMILIES, build_tiny_thinking_tokenizer, thinking_kwargs
from eagle3.think_format import PARSER_MARKERS, ThinkFormatError

FAMILIES = list(THINKING_FAMILIES)
REASONING = ["The user wants two colours.", "One more colour is asked."]
ANSWERS = ["Red and blue.", "Green is one."]
QUESTIONS = ["Name two colours.", "And one more?"]
#: families whose template has a thinking switch: their generation prompt closes the think block
#: (or opens the answer) with thinking off, so a text turn's reasoning has no place after it
SWITCHED = [f for f in FAMILIES if THINKING_FAMILIES[f].thinking_kwarg]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> a directory with its tiny tokenizer and published template."""
    root = tmp_path_factory.mktemp("formats")
    for family in FAMILIES:
        build_tiny_thinking_tokenizer(root / family, family, template_path(family))
    return {family: root / family for family in FAMILIES}


def chat_row(family: str, form: str) -> dict:
    """A two-turn chat whose assistant turns carry their reasoning as `form`."""
    open_, close = THINKING_FAMILIES[family].think_markers
    messages = []
    for q, r, a in zip(QUESTIONS, REASONING, ANSWERS, strict=True):
        turn = {"role": "assistant", "content": a}
        if form == "inline":
            turn["content"] = f"{open_}{r}{close}{a}"
        else:
            turn[form] = r
        messages += [{"role": "user", "content": q}, turn]
    return {"id": f"{family}-{form}", "messages": messages}


@pytest.mark.parametrize("family", FAMILIES)
def test_markers_are_read_from_the_template_and_agree_with_the_reasoning_parser(targets, family):
    fam = THINKING_FAMILIES[family]
    for thinking in (True, False):
        renderer = ChatRenderer(
            targets[family], chat_template_kwargs=thinking_kwargs(family, thinking)
        )
        assert (
            tuple(renderer.think_markers)
            == fam.think_markers
            == PARSER_MARKERS[fam.reasoning_parser]
        )
        renderer.check_reasoning_parser(fam.reasoning_parser)
    other = "seed_oss" if fam.think_markers[0] == "<think>" else "qwen3"
    with pytest.raises(ThinkFormatError, match=f"the reasoning parser '{other}' splits at"):
        renderer.check_reasoning_parser(other)
    one_token = all(len(renderer.encode(m)) == 1 for m in fam.think_markers)
    assert renderer.has_think_markers == one_token
    assert renderer.identity()["think_markers"] == list(fam.think_markers)


@pytest.mark.parametrize("form", ["reasoning_content", "reasoning", "inline"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("family", FAMILIES)
def test_text_chats_supervise_reasoning_and_answer_exactly_once(targets, family, thinking, form):
    fam = THINKING_FAMILIES[family]
    kwargs = thinking_kwargs(family, thinking)
    renderer = ChatRenderer(targets[family], chat_template_kwargs=kwargs)
    (conv,) = read_conversations([chat_row(family, form)]).conversations
    counts: Counter = Counter()
    turns = conversation_turns(renderer, conv, PrepareConfig(), counts)
    assert len(turns) == 2 and counts["from_text"] == 2
    dropped = thinking is False and family in SWITCHED
    open_, close = fam.think_markers
    end = renderer.encode(fam.turn_end)
    for k, turn in enumerate(turns):
        # after the template's own generation prompt for that turn
        messages = conv.messages[: 2 * k + 1]
        assert turn.prompt_ids == renderer.prompt_ids(messages, kwargs)
        text = renderer.decode(turn.completion_ids)
        assert text.count(ANSWERS[k]) == 1, text
        assert turn.completion_ids[-len(end) :] == end, text
        prompt_text = renderer.decode(turn.prompt_ids[-64:])
        prompt_opens = renderer.prompt_opens_think(turn.prompt_ids, kwargs)
        if dropped:
            assert REASONING[k] not in text and turn.num_reasoning_ids == 0, text
            continue
        assert text.count(REASONING[k]) == 1, text
        assert text.index(REASONING[k]) < text.index(ANSWERS[k])
        # one think block: opened by the prompt or by the turn, never both, closed once
        assert int(prompt_opens) + text.count(open_) == 1, (prompt_text, text)
        assert text.count(close) == 1
        reasoning_text = renderer.decode(turn.completion_ids[: turn.num_reasoning_ids])
        assert REASONING[k] in reasoning_text and reasoning_text.rstrip().endswith(close)
        assert ANSWERS[k] not in reasoning_text
    assert counts["reasoning_dropped_thinking_off"] == (2 if dropped else 0)
    assert counts["with_reasoning"] == (0 if dropped else 2)
    # the reader splits an inline <think> block; other markers are split by the target's own
    own_markers = form == "inline" and fam.think_markers[0] != "<think>"
    assert counts["inline_think"] == (2 if own_markers else 0)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_generated_turn_splits_into_reasoning_and_answer_and_history_keeps_them_apart(
    targets, family, thinking
):
    """The ids a target writes for a turn (here: its template's own rendering) split back into
    the reasoning and the answer with the markers and the template's answer wrapping left out;
    the next prompt renders that reasoning inside the template's markers, never as answer
    text."""
    fam = THINKING_FAMILIES[family]
    kwargs = thinking_kwargs(family, thinking)
    renderer = ChatRenderer(targets[family], chat_template_kwargs=kwargs)
    open_, close = fam.think_markers
    first = [{"role": "user", "content": QUESTIONS[0]}]
    written = {"role": "assistant", "content": ANSWERS[0], "reasoning": REASONING[0]}
    turn = renderer.text_turn([*first, written], kwargs)
    prompt = renderer.prompt_ids(first, kwargs)
    reasoning, answer = renderer.split_generated(prompt, turn.completion_ids, kwargs)
    assert answer.strip() == ANSWERS[0]
    if turn.reasoning_dropped:
        assert reasoning is None
        return
    assert reasoning.strip() == REASONING[0]
    n = renderer.num_reasoning_ids(prompt, turn.completion_ids, kwargs)
    assert renderer.decode(turn.completion_ids[:n]).endswith(close)
    assert not renderer.decode(turn.completion_ids[: n - 1]).endswith(close)
    stored = {"role": "assistant", "content": answer, "reasoning": reasoning}
    nxt = renderer.render_text([*first, stored, {"role": "user", "content": QUESTIONS[1]}], True)
    at = nxt.find(REASONING[0])
    while at >= 0:  # every occurrence of the reasoning sits inside a think block
        assert nxt.rfind(open_, 0, at) > nxt.rfind(close, 0, at), nxt
        at = nxt.find(REASONING[0], at + 1)
    assert nxt.count(ANSWERS[0]) == 1


def _custom_target(tmp_path, name: str, template: str) -> ChatRenderer:
    path = tmp_path / f"{name}.jinja"
    path.write_text(template)
    build_tiny_thinking_tokenizer(tmp_path / name, "qwen3", path)
    return tmp_path / name


#: ChatML that renders no reasoning and pre-fills no think block
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_a_template_shows_no_markers_for_is_refused_naming_the_template(tmp_path):
    target = _custom_target(tmp_path, "plain", CHATML)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat_row("qwen3", "reasoning_content")) + "\n")
    with pytest.raises(TemplateError) as refused:
        run_prepare(PrepareConfig(target=str(target), data=str(data), out=tmp_path / "out"))
    message = str(refused.value)
    assert "row qwen3-reasoning_content, assistant turn 1" in message
    assert f"the chat template of {target} shows no reasoning markers" in message
    assert not (tmp_path / "out").exists()
    # without reasoning the same template prepares
    data.write_text(json.dumps({"id": "a", "question": "q?", "answer": "An answer."}) + "\n")
    res = run_prepare(PrepareConfig(target=str(target), data=str(data), out=tmp_path / "ok"))
    assert res.turns["from_text"] == 1 and not res.turns.get("reasoning_tokens")


def test_a_misaligned_turn_names_the_first_difference_from_the_start_and_drop_says_why(tmp_path):
    """A template that rewrites the answer: the refusal names the row, the turn, the first
    differing token from the start of the turn and both token strings; with `drop` and nothing
    left, the error says how many turns were dropped and why."""
    rewrite = "{{ m.content | replace('blue', 'grey') }}"
    target = _custom_target(tmp_path, "rewrites", CHATML.replace("{{ m.content }}", rewrite))
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"id": "c1", "question": "Colours?", "answer": "Red and blue."}) + "\n"
    )
    cfg = PrepareConfig(target=str(target), data=str(data), out=tmp_path / "out")
    with pytest.raises(MisalignedTurnError) as refused:
        run_prepare(cfg)
    message = str(refused.value)
    assert "row c1, assistant turn 1 (messages[1])" in message
    assert "lacks its answer as given" in message
    tok = AutoTokenizer.from_pretrained(str(target))
    same = tok("Red and", add_special_tokens=False)["input_ids"]
    assert f"from the start of the turn is at token {len(same)}" in message
    assert "the data gives ' b" in message and "the chat template renders ' g" in message
    cfg = PrepareConfig(
        target=str(target), data=str(data), out=tmp_path / "out", misaligned_turns="drop"
    )
    with pytest.raises(
        ValueError, match=r"`misaligned_turns: drop` dropped 1 assistant turns.*row c1"
    ):
        run_prepare(cfg)


def test_the_kwargs_flag_help_shows_json_that_parses():
    example = "'{\"enable_thinking\": false}'"
    assert example in TEMPLATE_KWARGS_HELP
    assert parse_template_kwargs(example.strip("'")) == {"enable_thinking": False}


#: ChatML whose assistant turn writes its reasoning between `before` and `after`
def _reasoning_template(before: str, after: str) -> str:
    return CHATML.replace(
        "{{ m.content }}",
        "{% if m.reasoning_content %}" + before + "{{ m.reasoning_content }}" + after
        + "{% endif %}{{ m.content }}",
    )  # fmt: skip


def test_an_unknown_tag_pair_is_learned_and_unknown_markers_are_refused_naming_them(tmp_path):
    tagged = ChatRenderer(
        _custom_target(tmp_path, "tagged", _reasoning_template("<ponder>", "</ponder>"))
    )
    assert tagged.think_markers == ["<ponder>", "</ponder>"]
    turn = tagged.text_turn(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A.", "reasoning": "R"}]
    )
    assert tagged.decode(turn.completion_ids) == "<ponder>R</ponder>A.<|im_end|>"
    assert turn.reasoning_checked
    odd = ChatRenderer(_custom_target(tmp_path, "odd", _reasoning_template("~~", "!!")))
    assert odd.think_markers is None
    with pytest.raises(TemplateError, match=r"writes the reasoning between '.*~~' and '!!'"):
        odd.text_turn(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "A", "reasoning": "R"},
            ]
        )


def test_a_template_that_cannot_render_the_probes_still_renders_chats(tmp_path):
    strict = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn first') }}"
        "{% endif %}"
    )
    renderer = ChatRenderer(_custom_target(tmp_path, "strict", strict + CHATML))
    assert renderer.think_markers is None
    assert "a system turn first" in renderer.think_format().problem
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert renderer.decode(renderer.prompt_ids(chat)).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_turn_cut_at_max_new_tokens_ends_where_its_text_ends(targets, family):
    """A turn cut at max_new_tokens (`finish_reason: length`): no closing tags and no end of turn
    after its answer; cut inside its reasoning, no closing marker either."""
    fam = THINKING_FAMILIES[family]
    kwargs = thinking_kwargs(family, True)
    renderer = ChatRenderer(targets[family], chat_template_kwargs=kwargs)
    user = {"role": "user", "content": QUESTIONS[0]}
    for answer, ends_with in ((ANSWERS[0], ANSWERS[0]), ("", REASONING[0])):
        cut = {"role": "assistant", "content": answer, "reasoning": REASONING[0]}
        turn = renderer.text_turn([user, {**cut, "finish_reason": "length"}], kwargs)
        text = renderer.decode(turn.completion_ids)
        assert text.endswith(ends_with), text
        assert fam.turn_end not in text and text.count(REASONING[0]) == 1
        if not answer:
            assert fam.think_markers[1] not in text
