"""The target's chat template, applied in one place: every stage that turns messages into token ids
(regenerate, prepare, refine, evaluate) renders through `ChatRenderer`, with the same
`chat_template_kwargs` (Qwen3's `enable_thinking`, Kimi-K2.5's and DeepSeek-V3.1's `thinking`) and
the same `trust_remote_code`.

Thinking models. A turn the target generates is its ids: `<think>` reasoning `</think>` answer
end-of-turn (or, where the generation prompt already opens the block, as DeepSeek-R1-distill's
`<｜Assistant｜><think>\\n` does, reasoning `</think>` answer end-of-turn). The template renders a
conversation's *history* by its own rules — Kimi-K2-Thinking writes every earlier turn as
`<think></think>` + answer, DeepSeek-R1-distill drops the reasoning, Qwen3 keeps it only after the
last user turn — so a conversation is not one growing prefix. Training rows are therefore built per
assistant turn (`turn_rows`): the prompt ids the engine saw (the template's rendering of the
history + generation prompt) followed by the ids the target generated; consecutive turns whose
prompt extends the previous row share one row (the fast path of prefix-stable templates such as
ChatML). A turn that arrives as text only (a user's own dataset) is supervised as the template
renders it after its generation prompt, whitespace and closing tags included (`text_turn`), and
checked to hold the turn's answer and reasoning: what it cannot represent is refused naming the
first difference from the start of the turn, never trained on silently.

The reasoning markers are never a constant: eagle3.think_format reads them from the template
(`<think>`, Seed-OSS's `<seed:think>`, Kimi-K3's three-token `<|open|>think<|sep|>`; one token or
several) and finds them in ids by decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.errors import UserError
from eagle3.io import sha256_text
from eagle3.think_format import (
    ThinkFormat,
    check_parser_agrees,
    learn_think_format,
    safe_common_prefix,
)

#: message keys a chat template may read; everything else (token ids, finish reasons) stays ours
_TEMPLATE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class TemplateError(UserError, ValueError):
    """The target's chat template cannot render what a stage needs."""


class MisalignedTurnError(UserError, ValueError):
    """A text-only turn's ids differ from the chat template's rendering of that turn."""


def tokenizer_code(target: str | Path) -> str | None:
    """The tokenizer class a target directory brings as its own Python code (tokenizer_config.json
    `auto_map`, e.g. "tokenization_kimi.TikTokenTokenizer"), or None when transformers' own classes
    load it."""
    p = Path(target) / "tokenizer_config.json"
    if not p.is_file():
        return None
    auto_map = json.loads(p.read_text()).get("auto_map") or {}
    ref = auto_map.get("AutoTokenizer")
    if isinstance(ref, (list, tuple)):  # [slow class, fast class]
        ref = next((r for r in ref if r), None)
    return ref or None


def load_tokenizer(target: str | Path, trust_remote_code: bool = False, stage: str = "prepare"):
    """The target's tokenizer, which must have a chat template. A tokenizer that is Python code
    shipped with the model runs only with `trust_remote_code` (the error names the key to set)."""
    from transformers import AutoTokenizer

    path = Path(target)
    if not path.exists():
        raise FileNotFoundError(
            f"target {target} does not exist (expected a model directory with a tokenizer)"
        )
    code = tokenizer_code(path)
    if code and not trust_remote_code:
        raise ConfigError(
            f"the tokenizer of {target} is Python code shipped with the model ({code}, "
            f"tokenizer_config.json `auto_map`), which {stage} does not run unless you opt in: "
            f"set `trust_remote_code: true` at the top of the config file (or "
            f"`{stage}.trust_remote_code: true`, or pass --trust-remote-code) if you trust that "
            "directory"
        )
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if not getattr(tok, "chat_template", None):
        raise TemplateError(
            f"the tokenizer of {target} has no chat template; add chat_template.jinja to the "
            "target directory"
        )
    return tok


@dataclass
class Misalignment:
    """Where a text turn as its data gives it and the template's rendering of that turn first
    differ, counted from the start of the turn."""

    position: int  # token index from the start of the turn
    ours: str  # the text of the tokens from there, "|" between tokens
    template: str
    span: str  # "answer" | "reasoning": what the template's rendering lacks

    def describe(self) -> str:
        return (
            f"the chat template's rendering of the turn lacks its {self.span} as given; the "
            f"first difference from the start of the turn is at token {self.position}: the data "
            f"gives {self.ours!r}, the chat template renders {self.template!r}"
        )


@dataclass
class TurnIds:
    """One assistant turn as training data: the prompt the engine saw, the ids the target wrote."""

    prompt_ids: list[int]
    completion_ids: list[int]
    #: "generated" (ids the target generated) | "text" (the template's rendering of its text)
    source: str
    #: how many of completion_ids are the reasoning span (think markers included)
    num_reasoning_ids: int = 0


@dataclass
class TextTurn:
    """A text-only assistant turn as the ids the template renders after its generation prompt."""

    completion_ids: list[int]
    #: the reasoning was found in the template's own rendering (False: the template renders none
    #: of this turn's, and it was placed between the learned markers)
    reasoning_checked: bool = False
    #: the turn's reasoning was left out: the generation prompt closes the think block (thinking
    #: off) or leaves it no place
    reasoning_dropped: bool = False
    #: the reasoning came inline in the content, in the target's own markers
    inline: bool = False


class ChatRenderer:
    """The target's tokenizer and chat template with this run's `chat_template_kwargs`, and the
    reasoning format the template writes (eagle3.think_format, learned on first use)."""

    def __init__(
        self,
        target: str | Path,
        *,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        stage: str = "prepare",
    ):
        self.target = str(target)
        self.trust_remote_code = bool(trust_remote_code)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tokenizer = load_tokenizer(target, self.trust_remote_code, stage)
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise TemplateError(
                f"the tokenizer of {target} has no eos token: the end of an assistant turn "
                "cannot be found; set `eos_token` in tokenizer_config.json"
            )
        self.stop_ids = [int(tok.eos_token_id), *_generation_eos_ids(target)]
        self.stop_texts = [tok.convert_ids_to_tokens(i) for i in dict.fromkeys(self.stop_ids)]
        self._formats: dict[str, ThinkFormat] = {}
        fmt = self.think_format()
        self.end_of_turn_id = _single_token_id(tok, fmt.end) or int(tok.eos_token_id)
        # one-token markers: what evaluate's per-span calls stop at
        markers = fmt.markers or [None, None]
        self.think_start_id = _single_token_id(tok, markers[0]) if markers[0] else None
        self.think_end_id = _single_token_id(tok, markers[1]) if markers[1] else None
        if self.think_start_id is None or self.think_end_id is None:
            self.think_start_id = self.think_end_id = None

    @property
    def has_think_markers(self) -> bool:
        """The markers are one token each (evaluate splits its calls at them)."""
        return self.think_end_id is not None

    @property
    def think_markers(self) -> list[str] | None:
        """[open, close] as the template writes them (any number of tokens each), or None."""
        return self.think_format().markers

    def think_format(self, chat_template_kwargs: dict[str, Any] | None = None) -> ThinkFormat:
        """The template's reasoning format with a row's (or the run's) kwargs, learned once."""
        kwargs = self.kwargs_for(chat_template_kwargs)
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in self._formats:
            self._formats[key] = learn_think_format(
                lambda m, g, kw: self.render_text(m, g, kw),
                kwargs,
                self.stop_texts,
                self.tokenizer.eos_token,
            )
        return self._formats[key]

    def check_reasoning_parser(self, parser: str | None) -> None:
        """Refuse a vLLM reasoning parser that splits at other markers than the template writes."""
        if parser:
            check_parser_agrees(self.think_format(), parser, self.target)

    def identity(self) -> dict[str, Any]:
        """What a manifest records of how prompts were rendered."""
        fmt = self.think_format()
        return {
            "chat_template_sha256": sha256_text(self.tokenizer.chat_template),
            "chat_template_kwargs": self.chat_template_kwargs,
            "trust_remote_code": self.trust_remote_code,
            "think_markers": fmt.markers,
            "think_markers_from": fmt.learned_from,
        }

    # ------------------------------------------------------------------------------- rendering
    def kwargs_for(self, row_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """A row's own kwargs (a source's thinking switch) replace the run's."""
        return dict(self.chat_template_kwargs if row_kwargs is None else row_kwargs)

    def render_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.kwargs_for(chat_template_kwargs),
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The ids' text with every token written out (special ones included)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(
        self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """The ids a server feeds the target to write the next assistant turn."""
        return self.encode(self.render_text(messages, True, chat_template_kwargs))

    def render_ids(
        self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """The whole conversation as the template renders it (no generation prompt)."""
        return self.encode(self.render_text(messages, False, chat_template_kwargs))

    # ----------------------------------------------------------------------- generated turns
    def _prompt_block(self, prompt: str, fmt: ThinkFormat) -> str | None:
        """ "open" when the generation prompt leaves a think block open (DeepSeek-R1-distill's
        `<think>\\n`, Kimi-K3's `<|open|>think<|sep|>`), "closed" when it closes one (thinking
        off: Qwen3's empty block, DeepSeek-V3.1's `</think>`), else None. Read from the prompt's
        text after its last end-of-turn token (the generation prompt and the last user turn)."""
        if not fmt.markers:
            return None
        cut = max((prompt.rfind(s) + len(s) for s in self.stop_texts if s in prompt), default=0)
        tail = prompt[cut:]
        at_open, at_close = tail.rfind(fmt.open), tail.rfind(fmt.close)
        if at_open < 0 and at_close < 0:
            return None
        return "open" if at_open > at_close else "closed"

    def prompt_opens_think(
        self, prompt_ids: list[int], chat_template_kwargs: dict[str, Any] | None = None
    ) -> bool:
        """The generation prompt pre-fills the reasoning's opening marker: the target's first
        token is already reasoning."""
        fmt = self.think_format(chat_template_kwargs)
        return self._prompt_block(self.decode(prompt_ids[-64:]), fmt) == "open"

    def _ids_through(self, ids: list[int], text: str) -> int | None:
        """The fewest leading ids whose text holds `text` (None: it never occurs)."""
        if text not in self.decode(ids):
            return None
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if text not in self.decode(ids[:mid]) else (low, mid)
        return low

    def num_reasoning_ids(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> int:
        """How many leading ids of a turn are reasoning (up to and including the closing
        marker, however many tokens it spans; all of them when the block never closes)."""
        fmt = self.think_format(chat_template_kwargs)
        if not fmt.markers or not completion_ids:
            return 0
        through = self._ids_through(completion_ids, fmt.close)
        if through is not None:
            return through
        opened = self.prompt_opens_think(prompt_ids, chat_template_kwargs) or self.decode(
            completion_ids
        ).lstrip().startswith(fmt.open)
        return len(completion_ids) if opened else 0

    def split_generated(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str | None, str]:
        """(reasoning, answer) text of a generated turn, as the template takes them back as a
        message's reasoning field and content: the markers, the template's own wrapping of the
        answer (Kimi-K3's response channel) and the end-of-turn token left out; special tokens
        dropped (as a server's reasoning parser returns them). Reasoning None when the turn
        has no think block."""
        fmt = self.think_format(chat_template_kwargs)
        n = self.num_reasoning_ids(prompt_ids, completion_ids, chat_template_kwargs)
        text = self.decode(completion_ids)
        reasoning = None
        if n:
            head = self.decode(completion_ids[:n])
            at = head.find(fmt.close)
            if at < 0:
                trace, text = head, text[len(head) :]
            else:
                trace, text = head[:at], text[at + len(fmt.close) :]
            if trace.lstrip().startswith(fmt.open):  # the turn opened the block itself
                trace = trace.lstrip()[len(fmt.open) :]
            if fmt.end in trace:  # a trace that never closed, ended by the end-of-turn token
                trace = trace[: trace.rfind(fmt.end)]
            reasoning = self._plain(trace)
        answer = text
        wrap_open, wrap_close = fmt.answer_open.strip(), fmt.answer_close.strip()
        if wrap_open and answer.lstrip().startswith(wrap_open):
            answer = answer.lstrip()[len(wrap_open) :]
        for closing in (wrap_close, fmt.end):
            if closing and closing in answer:
                answer = answer[: answer.rfind(closing)]
        return reasoning, self._plain(answer)

    def _plain(self, text: str) -> str:
        """`text` without the tokenizer's special tokens (as decoding skips them)."""
        return self.tokenizer.decode(self.encode(text), skip_special_tokens=True) if text else ""

    # ---------------------------------------------------------------------------- text turns
    def text_turn(
        self,
        messages: list[dict[str, Any]],
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> TextTurn:
        """A text-only assistant turn (`messages[-1]`) as the template renders it after the
        generation prompt of `messages[:-1]`: everything it writes from there to the end of the
        turn (whitespace, closing tags and the end-of-turn token included), checked to hold the
        turn's answer and, where the template renders it, its reasoning. Where the template
        renders none of this turn's reasoning (Kimi-K2-Thinking empties it, DeepSeek drops it)
        the reasoning is placed between the learned markers (`reasoning_checked` False); where
        the generation prompt has closed the block (thinking off) it is left out
        (`reasoning_dropped`). A turn cut at max_new_tokens (`finish_reason: length`) has no
        end-of-turn token. Raises MisalignedTurnError (without the row) when the rendering lacks
        the answer or the reasoning as given."""
        fmt = self.think_format(chat_template_kwargs)
        history, message = messages[:-1], dict(messages[-1])
        out = TextTurn([])
        if message.get("reasoning") is None and fmt.markers and fmt.close in message["content"]:
            head, _, answer = message["content"].partition(fmt.close)  # inline, own markers
            if fmt.open not in head or head.lstrip().startswith(fmt.open):
                message["reasoning"] = head.lstrip().removeprefix(fmt.open)
                message["content"], out.inline = answer, True
        reasoning = message.get("reasoning")
        if reasoning is not None and not reasoning.strip():
            reasoning = None
        if reasoning is not None and not fmt.markers:
            why = fmt.problem or (
                "it renders no reasoning, and neither its generation prompt nor its turns show "
                "a think block"
            )
            raise TemplateError(
                f"the chat template of {self.target} shows no reasoning markers ({why}), so a "
                "turn's reasoning cannot be placed where the target writes it: leave the "
                "reasoning out (`prepare.reasoning: drop`), or use the target's own chat template"
            )
        prompt = self.render_text(history, True, chat_template_kwargs)
        block = self._prompt_block(prompt, fmt)
        committed = fmt.thinking_answer_open.strip() and prompt.rstrip().endswith(
            fmt.thinking_answer_open.strip()
        )  # the prompt opened the answer (Kimi-K3, thinking off)
        if reasoning is not None and (block == "closed" or committed):
            reasoning, out.reasoning_dropped = None, True
        if reasoning is None:
            message.pop("reasoning", None)
        rendered = self.render_text([*history, message], False, chat_template_kwargs)
        answer = message["content"]
        turn = self._turn_text(history, prompt, rendered, answer, fmt, block, chat_template_kwargs)
        if reasoning is not None:
            if reasoning.strip() in turn and self._renders_reasoning(
                history, message, rendered, chat_template_kwargs
            ):
                out.reasoning_checked = True
            elif fmt.open in turn and turn.find(fmt.close, turn.find(fmt.open)) >= 0:
                at = turn.find(fmt.open) + len(fmt.open)  # the empty block the template writes
                turn = turn[:at] + reasoning + turn[at:]
            elif block == "open":
                closes = turn.lstrip().startswith(fmt.close)
                turn = reasoning + ("" if closes else fmt.close) + turn
            else:  # a template that drops the reasoning and pre-fills nothing
                turn = fmt.open + reasoning + fmt.close + turn
        elif block == "open" and fmt.close not in turn:  # the target closes the block at once
            turn = fmt.close + turn
        cut = message.get("finish_reason") == "length"
        turn = self._cut_at_end(turn, reasoning, answer, fmt, cut)
        problem = self._lacks(turn, reasoning, answer)
        if problem is not None:
            given = (
                ("" if block == "open" or reasoning is None else fmt.open)
                + (f"{reasoning}{fmt.close}" if reasoning is not None else "")
                + fmt.answer_open
                + answer
                + fmt.answer_close
                + fmt.end
            )
            raise MisalignedTurnError(self._difference(given, turn, problem).describe())
        out.completion_ids = self.encode(turn)
        return out

    def _turn_text(
        self,
        history: list[dict[str, Any]],
        prompt: str,
        rendered: str,
        answer: str,
        fmt: ThinkFormat,
        block: str | None,
        kwargs: dict[str, Any] | None,
    ) -> str:
        """The text the template renders after the generation prompt for the last turn. Where
        it renders the turn in its history form instead (DeepSeek: no pre-filled `<think>`), the
        turn starts where a head of the generation prompt's own text (cut between tokens, never
        inside a marker) last ends in the rendering before the answer, the opening the prompt
        already wrote left out."""
        if rendered.startswith(prompt):
            return rendered[len(prompt) :]
        before = self.render_text(history, False, kwargs)
        markers = [m for m in (fmt.open, fmt.close, *self.stop_texts) if m]
        gen = prompt[safe_common_prefix(prompt, before, markers) :]
        limit = rendered.rfind(answer.strip()) if answer.strip() else len(rendered)
        inside = {
            k for m in markers for at in _occurrences(gen, m) for k in range(at + 1, at + len(m))
        }
        cuts, text = [], ""  # the generation prompt's token boundaries
        for i in self.encode(gen):
            text += self.tokenizer.decode([i])
            cuts.append(len(text))
        starts = [
            rendered.rfind(gen[:k], 0, max(limit, 0)) + k
            for k in cuts
            if k not in inside and rendered.rfind(gen[:k], 0, max(limit, 0)) >= 0
        ]
        if starts:  # the latest place a head of the generation prompt ends
            turn = rendered[max(starts) :]
        else:
            turn = rendered[safe_common_prefix(prompt, rendered, markers) :]
        if block == "open" and fmt.open and turn.lstrip().startswith(fmt.open):
            turn = turn.lstrip()[len(fmt.open) :]
        return turn

    def _renders_reasoning(
        self,
        history: list[dict[str, Any]],
        message: dict[str, Any],
        rendered: str,
        kwargs: dict[str, Any] | None,
    ) -> bool:
        """The template renders this turn's reasoning: the rendering changes without it."""
        without = {k: v for k, v in message.items() if k != "reasoning"}
        return self.render_text([*history, without], False, kwargs) != rendered

    def _cut_at_end(
        self, turn: str, reasoning: str | None, answer: str, fmt: ThinkFormat, cut: bool
    ) -> str:
        """The turn up to and including the first end-of-turn token after its answer (the
        learned end appended where the template renders none: GLM's last turn). A turn cut at
        max_new_tokens ends where its text ends: after its answer, or inside its reasoning when
        it has no answer (no closing tags, no end-of-turn token)."""
        if cut:
            last = answer if answer.strip() else reasoning or ""
            if not last.strip() or last.strip() not in turn:
                return turn
            end = turn.rfind(last.strip()) + len(last.strip())
            trailing = last[len(last.rstrip()) :]  # its own trailing whitespace, where rendered
            return turn[: end + len(trailing) * turn.startswith(trailing, end)]
        at = turn.rfind(answer.strip()) + len(answer.strip()) if answer.strip() in turn else 0
        hits = [turn.find(s, at) for s in self.stop_texts if s and turn.find(s, at) >= 0]
        if hits:
            end = min(hits)
            stop = next(s for s in self.stop_texts if s and turn.startswith(s, end))
            return turn[: end + len(stop)]
        return turn + fmt.end

    def _lacks(self, turn: str, reasoning: str | None, answer: str) -> str | None:
        """ "reasoning" or "answer" when the turn's text does not hold it (stripped, in order)."""
        at = 0
        if reasoning is not None:
            at = turn.find(reasoning.strip())
            if at < 0:
                return "reasoning"
            at += len(reasoning.strip())
        return None if answer.strip() in turn[at:] else "answer"

    def _difference(self, ours: str, template: str, span: str) -> Misalignment:
        """Where two texts' tokens first differ from the start, with the tokens from there."""
        a, b = self.encode(ours), self.encode(template)
        pos = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

        def tokens(ids: list[int]) -> str:  # each token's text, "|" between tokens
            return "|".join(self.tokenizer.decode([i]) for i in ids[pos : pos + 4])

        return Misalignment(position=pos, ours=tokens(a), template=tokens(b), span=span)


def _occurrences(text: str, sub: str) -> list[int]:
    out, at = [], text.find(sub)
    while at >= 0:
        out.append(at)
        at = text.find(sub, at + 1)
    return out


def _generation_eos_ids(target: str | Path) -> list[int]:
    """The end-of-generation ids of the target's generation_config.json besides the tokenizer's
    eos (GLM stops at `<|user|>` and `<|observation|>` too)."""
    p = Path(target) / "generation_config.json"
    if not p.is_file():
        return []
    eos = json.loads(p.read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if isinstance(i, int)]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them: a turn's reasoning under both names templates use
    (`reasoning_content`: Kimi-K2, Qwen3, DeepSeek-V3.1; `reasoning`: newer vLLM), our token ids
    and finish reasons left out."""
    out = []
    for m in messages:
        t = {k: m[k] for k in _TEMPLATE_KEYS if k in m}
        if m.get("reasoning") is not None:
            t["reasoning_content"] = t["reasoning"] = m["reasoning"]
        out.append(t)
    return out


def turn_rows(turns: list[TurnIds]) -> list[tuple[list[int], list[int], list[int]]]:
    """Turns -> training rows (input_ids, loss_mask, reasoning_mask): a turn whose prompt begins
    with the row so far extends it (its new context unsupervised, its ids supervised), else it
    starts a new row. reasoning_mask marks the supervised reasoning ids."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    mask: list[int] = []
    think: list[int] = []
    for t in turns:
        if ids and t.prompt_ids[: len(ids)] == ids:
            context = t.prompt_ids[len(ids) :]
        else:
            if ids:
                rows.append((ids, mask, think))
            ids, mask, think, context = [], [], [], t.prompt_ids
        n, r = len(t.completion_ids), t.num_reasoning_ids
        ids = ids + context + t.completion_ids
        mask = mask + [0] * len(context) + [1] * n
        think = think + [0] * len(context) + [1] * r + [0] * (n - r)
    if ids:
        rows.append((ids, mask, think))
    return rows


def _single_token_id(tok: Any, text: str) -> int | None:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None
