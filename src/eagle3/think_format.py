"""A thinking target's reasoning format, learned from its own chat template.

Every family delimits its reasoning its own way: Qwen3, DeepSeek, Kimi-K2, GLM and MiniMax write
`<think>` … `</think>`, ByteDance Seed-OSS `<seed:think>` … `</seed:think>`, Kimi-K3
`<|open|>think<|sep|>` … `<|close|>think<|sep|>` (three tokens each), and a plain tokenizer may
split `<think>` into pieces. So the markers are never a constant: `learn_think_format` renders
probe messages through the template (a turn with reasoning `PROBE_REASONING` and answer
`PROBE_ANSWER`, as the current turn and as history, with the run's `chat_template_kwargs` and, where
those leave thinking off, with the usual switches on) and reads what surrounds the reasoning, as
text; a marker is then found in any token sequence by decoding, however many tokens it spans.

The markers read are held against the pairs vLLM's reasoning parsers split at
(`PARSER_MARKERS`), a `<tag>`/`</tag>` pair of the template's own is accepted as such, and where
the template never renders reasoning the pair is read from its generation prompt or its empty
block (DeepSeek-R1-distill pre-fills `<think>\\n`, Kimi-K2-Thinking writes `<think></think>`).

The same probes give the rest of an assistant turn's format: the text the template writes
between the reasoning block and the answer (`answer_open`: Qwen3's "\\n\\n", Kimi-K3's
`<|open|>response<|sep|>`), after the answer (`answer_close`), and the end-of-turn token the target
writes (`end`: the first stop token after the answer; GLM renders none at the end of a
conversation, so its end is the stop token it renders before the next user turn, `<|user|>`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3.errors import UserError

#: probe texts: words no template writes of its own
PROBE_QUESTION = "Probe question one"
PROBE_NEXT = "Probe question two"
PROBE_REASONING = "Probe reasoning words"
PROBE_ANSWER = "Probe answer words"

#: the reasoning markers of vLLM's reasoning parsers (`--reasoning-parser`), by parser name
PARSER_MARKERS: dict[str, tuple[str, str]] = {
    **{
        name: ("<think>", "</think>")
        for name in (
            "deepseek_r1",
            "deepseek_v3",
            "qwen3",
            "kimi_k2",
            "glm45",
            "glm47",
            "minimax_m2",
            "minimax_m2_append_think",
            "ernie45",
            "hunyuan_a13b",
            "olmo3",
        )
    },
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    "mistral": ("[THINK]", "[/THINK]"),
}

#: switches that turn thinking on in the published templates (Qwen3/GLM; Kimi/DeepSeek-V3.1)
THINKING_ON = ({"enable_thinking": True}, {"thinking": True})

_TAG = re.compile(r"<([A-Za-z][\w:.-]*)>$")


class ThinkFormatError(UserError, ValueError):
    """The template's reasoning format cannot be read, or disagrees with a reasoning parser."""


@dataclass(frozen=True)
class ThinkFormat:
    """How a chat template writes an assistant turn, learned from probes (texts, not ids)."""

    #: the reasoning markers; None when the template shows none
    open: str | None
    close: str | None
    #: where the markers were read: "rendered reasoning", "generation prompt", "empty block"
    learned_from: str | None
    #: the end-of-turn text the target writes (a stop token)
    end: str
    #: what the template writes between the reasoning block and the answer, and after the answer
    #: before `end` ("" when nothing)
    answer_open: str = ""
    answer_close: str = ""
    #: why no markers could be read although the template renders reasoning (None: no problem)
    problem: str | None = None
    #: what the template writes between the close marker and the answer where it renders
    #: reasoning (Kimi-K3's `<|open|>response<|sep|>`): a generation prompt ending with it has
    #: committed the turn to its answer
    thinking_answer_open: str = ""

    @property
    def markers(self) -> list[str] | None:
        return [self.open, self.close] if self.open and self.close else None


def probe_messages(with_reasoning: bool = True, history: bool = False) -> list[dict[str, Any]]:
    """A user turn and an assistant turn (reasoning + answer), and a next user turn as history."""
    turn: dict[str, Any] = {"role": "assistant", "content": PROBE_ANSWER}
    if with_reasoning:
        turn["reasoning_content"] = turn["reasoning"] = PROBE_REASONING
    msgs = [{"role": "user", "content": PROBE_QUESTION}, turn]
    return msgs + [{"role": "user", "content": PROBE_NEXT}] if history else msgs


def learn_think_format(
    render: Callable[[list[dict[str, Any]], bool, dict[str, Any]], str],
    kwargs: dict[str, Any],
    stop_texts: list[str],
    eos_text: str,
) -> ThinkFormat:
    """The format of the template `render(messages, add_generation_prompt, kwargs)` writes with
    `kwargs`; the markers from the first of `kwargs`, then `kwargs` with each THINKING_ON switch,
    that shows them. `stop_texts`: the texts of the tokens that end a generation. A template
    that cannot render the probes (one that demands a system turn, say) shows no markers, and
    the reason is kept (`problem`): reasoning given to it is refused with it."""
    try:
        return _learn(render, kwargs, stop_texts, eos_text)
    except Exception as e:  # the template's own error (jinja's raise_exception and the like)
        return ThinkFormat(
            None, None, None, eos_text, problem=f"it cannot render the probe turns: {e}"
        )


def _learn(
    render: Callable[[list[dict[str, Any]], bool, dict[str, Any]], str],
    kwargs: dict[str, Any],
    stop_texts: list[str],
    eos_text: str,
) -> ThinkFormat:
    found, problem = None, None
    for extra in ({}, *THINKING_ON):
        if extra and all(kwargs.get(k) == v for k, v in extra.items()):
            continue
        try:
            found = _read_markers(render, {**kwargs, **extra})
        except ThinkFormatError as e:
            problem = problem or str(e)
        except Exception:  # a switch this template does not take
            if not extra:
                raise
        if found is not None:
            problem = None
            break
    prompt = render(probe_messages()[:1], True, kwargs)
    current = render(probe_messages(), False, kwargs)
    history = render(probe_messages(history=True), False, kwargs)
    end = _end_text(current, stop_texts) or _end_text(history, stop_texts) or eos_text
    answer_open, answer_close = _answer_wrapping(prompt, current, end, found)
    open_, close, source, thinking_open = found if found else (None, None, None, "")
    return ThinkFormat(open_, close, source, end, answer_open, answer_close, problem, thinking_open)


def _read_markers(
    render: Callable[[list[dict[str, Any]], bool, dict[str, Any]], str], kwargs: dict[str, Any]
) -> tuple[str, str, str, str] | None:
    """(open, close, where read, what follows the close marker before the answer) from the
    probes rendered with kwargs, or None."""
    prompt = render(probe_messages()[:1], True, kwargs)
    for text in (render(probe_messages(), False, kwargs),
                 render(probe_messages(history=True), False, kwargs)):  # fmt: skip
        at = text.find(PROBE_REASONING)
        answer = text.find(PROBE_ANSWER, at + 1)
        if at < 0 or answer < 0:
            continue
        before, between = text[:at].rstrip(), text[at + len(PROBE_REASONING) : answer].lstrip()
        pair = _known_pair(lambda o, c, b=before, a=between: b.endswith(o) and a.startswith(c))
        if pair is None:
            tag = _TAG.search(before)
            if tag and between.startswith(f"</{tag.group(1)}>"):
                pair = (tag.group(0), f"</{tag.group(1)}>")
        if pair is None:
            raise ThinkFormatError(
                f"the template writes the reasoning between {before[-40:]!r} and "
                f"{between[:40]!r}: no reasoning markers known to a vLLM reasoning parser "
                f"({', '.join(sorted({o for o, _ in PARSER_MARKERS.values()}))}) nor a "
                "<tag>...</tag> pair"
            )
        return (*pair, "rendered reasoning", between[len(pair[1]) :])
    # the reasoning is never rendered: a pre-filled opening in the generation prompt, or an empty
    # block (or a lone closing marker) where the answer's turn starts
    turn = render(probe_messages(with_reasoning=False), False, kwargs)
    known = [m for pair in PARSER_MARKERS.values() for m in pair]
    start = safe_common_prefix(prompt, turn, known)
    gen_tail, turn_head = prompt[start:], turn[start : turn.find(PROBE_ANSWER)]
    pair = _known_pair(lambda o, c: gen_tail.rstrip().endswith(o))
    if pair is not None:
        return (*pair, "generation prompt", "")
    pair = _known_pair(lambda o, c: c in turn_head or c in gen_tail)
    return None if pair is None else (*pair, "empty block", "")


def _known_pair(test: Callable[[str, str], bool]) -> tuple[str, str] | None:
    """The longest PARSER_MARKERS pair that passes `test(open, close)`."""
    pairs = sorted(set(PARSER_MARKERS.values()), key=lambda p: -len(p[0]))
    return next((p for p in pairs if test(*p)), None)


def _end_text(text: str, stop_texts: list[str]) -> str | None:
    """The first stop token written after the probe answer in `text`."""
    after = text.find(PROBE_ANSWER)
    if after < 0:
        return None
    after += len(PROBE_ANSWER)
    hits = [(text.find(s, after), s) for s in stop_texts if s and text.find(s, after) >= 0]
    return min(hits)[1] if hits else None


def _answer_wrapping(
    prompt: str, current: str, end: str, found: tuple[str, str, str, str] | None
) -> tuple[str, str]:
    """(answer_open, answer_close) of the current probe turn: what the template writes between
    the reasoning's close marker (or the generation prompt) and the answer, and between the
    answer and the end of the turn."""
    at = current.find(PROBE_ANSWER)
    if at < 0:
        return "", ""
    tail = current[at + len(PROBE_ANSWER) :]
    answer_close = tail[: tail.find(end)] if end in tail else ""
    head = current[:at]
    if found and found[1] in head:
        answer_open = head[head.rfind(found[1]) + len(found[1]) :]
    elif current.startswith(prompt):
        answer_open = head[len(prompt) :]
    else:
        answer_open = ""
    return answer_open, answer_close


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def safe_common_prefix(a: str, b: str, markers: list[str]) -> int:
    """The length of the common prefix of `a` and `b`, moved back so that it never ends inside a
    marker one of them continues (`<think>` vs `</think>` share their `<`)."""
    n = _common_prefix(a, b)
    moved = True
    while moved:
        moved = False
        for m in markers:
            for k in range(min(len(m) - 1, n), 0, -1):
                inside = a[n - k : n - k + len(m)] == m or b[n - k : n - k + len(m)] == m
                if a[n - k : n] == m[:k] and inside:
                    n, moved = n - k, True
                    break
    return n


def check_parser_agrees(fmt: ThinkFormat, parser: str, template: str) -> None:
    """A ThinkFormatError when vLLM's reasoning parser `parser` splits at other markers than the
    template `template` (its name or path) writes."""
    want = PARSER_MARKERS.get(parser)
    if want is None or fmt.markers is None or tuple(fmt.markers) == want:
        return
    raise ThinkFormatError(
        f"the chat template of {template} writes reasoning between {fmt.open!r} and "
        f"{fmt.close!r}, but the reasoning parser {parser!r} splits at {want[0]!r} / "
        f"{want[1]!r}: its split would merge reasoning into the answer; use the parser of the "
        "target's family"
    )
