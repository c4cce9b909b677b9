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
ChatML). A turn that arrives as text only (a user's own dataset) is tokenized as the target would
have written it and checked against the template's own rendering of that turn
(`check_text_turn`): the first differing token is reported, never trained on silently.

The think markers are recognised when the vocabulary holds `<think>` and `</think>` as one token
each (Kimi-K2, Qwen3, DeepSeek-R1/V3.1, GLM, MiniMax); a target without them has no reasoning
span.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.errors import UserError
from eagle3.io import sha256_text

THINK_START = "<think>"
THINK_END = "</think>"

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
    """Where a text turn's ids (as the target would write the text) and the template's rendering
    of that turn first differ."""

    position: int  # index in the turn's answer ids (all its ids when `span` is "reasoning")
    ours: str  # the text of the tokens from there, "|" between tokens
    template: str
    span: str  # "answer" | "reasoning"

    def describe(self) -> str:
        return (
            f"the {self.span} differs at token {self.position}: the text gives {self.ours!r}, "
            f"the chat template renders {self.template!r}"
        )


@dataclass
class TurnIds:
    """One assistant turn as training data: the prompt the engine saw, the ids the target wrote."""

    prompt_ids: list[int]
    completion_ids: list[int]
    #: "generated" (ids the target generated) | "text" (tokenized from the turn's text)
    source: str
    #: how many of completion_ids are the reasoning span (think markers included)
    num_reasoning_ids: int = 0


class ChatRenderer:
    """The target's tokenizer and chat template with this run's `chat_template_kwargs`."""

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
        self.think_start_id = _single_token_id(tok, THINK_START)
        self.think_end_id = _single_token_id(tok, THINK_END)
        if self.think_start_id is None or self.think_end_id is None:
            self.think_start_id = self.think_end_id = None
        if tok.eos_token_id is None:
            raise TemplateError(
                f"the tokenizer of {target} has no eos token: the end of an assistant turn "
                "cannot be found; set `eos_token` in tokenizer_config.json"
            )
        self.end_of_turn_id = int(tok.eos_token_id)

    @property
    def has_think_markers(self) -> bool:
        return self.think_end_id is not None

    def identity(self) -> dict[str, Any]:
        """What a manifest records of how prompts were rendered."""
        return {
            "chat_template_sha256": sha256_text(self.tokenizer.chat_template),
            "chat_template_kwargs": self.chat_template_kwargs,
            "trust_remote_code": self.trust_remote_code,
            "think_markers": [THINK_START, THINK_END] if self.has_think_markers else None,
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
    def prompt_opens_think(self, prompt_ids: list[int]) -> bool:
        """The generation prompt pre-fills `<think>` (DeepSeek-R1-distill): the target's first
        token is already reasoning."""
        if not self.has_think_markers:
            return False
        for i in reversed(prompt_ids[-8:]):
            if i == self.think_end_id:
                return False
            if i == self.think_start_id:
                return True
        return False

    def num_reasoning_ids(self, prompt_ids: list[int], completion_ids: list[int]) -> int:
        """How many leading ids of a generated turn are reasoning (up to and including
        `</think>`; all of them when the block never closes)."""
        if not self.has_think_markers:
            return 0
        if self.think_end_id in completion_ids:
            return completion_ids.index(self.think_end_id) + 1
        opened = self.prompt_opens_think(prompt_ids) or (
            completion_ids[:1] == [self.think_start_id]
        )
        return len(completion_ids) if opened else 0

    def split_generated(
        self, prompt_ids: list[int], completion_ids: list[int]
    ) -> tuple[str | None, str]:
        """(reasoning, answer) text of a generated turn; reasoning None when it has no think
        block. Special tokens are left out of both texts (as a server's reasoning parser returns
        them)."""
        n = self.num_reasoning_ids(prompt_ids, completion_ids)
        decode = self.tokenizer.decode
        if not n:
            return None, decode(completion_ids, skip_special_tokens=True)
        trace = [i for i in completion_ids[:n] if i not in (self.think_start_id, self.think_end_id)]
        return (
            decode(trace, skip_special_tokens=True),
            decode(completion_ids[n:], skip_special_tokens=True),
        )

    # ---------------------------------------------------------------------------- text turns
    def text_completion_ids(self, prompt_ids: list[int], message: dict[str, Any]) -> list[int]:
        """A text-only assistant turn as the ids the target would write: `<think>` (unless the
        prompt opened it) reasoning `</think>` answer, tokenized, then the end-of-turn token —
        unless the turn says it was cut (`finish_reason: length`): the target wrote no end."""
        text = message.get("content") or ""
        reasoning = message.get("reasoning")
        if reasoning is not None and self.has_think_markers:
            opened = self.prompt_opens_think(prompt_ids)
            text = ("" if opened else THINK_START) + reasoning + THINK_END + text
        cut = message.get("finish_reason") == "length"
        return self.encode(text) + ([] if cut else [self.end_of_turn_id])

    def check_text_turn(
        self,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        completion_ids: list[int],
        num_reasoning: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Misalignment | None, bool]:
        """Hold a text turn's ids (`messages[-1]` after `prompt_ids`, tokenized by
        `text_completion_ids`) against the template's rendering of the conversation through that
        turn: its answer must be the same ids as the rendering's last turn ends with; its whole
        completion too where the template renders the last turn's reasoning (read from the end of
        the prompt when the rendering starts with it). -> (the first difference or None, whether
        the reasoning was checked)."""
        full = self.render_ids(messages, chat_template_kwargs)
        end = _last_index(full, self.end_of_turn_id)
        answer = completion_ids[num_reasoning:]
        cut = completion_ids[-1:] != [self.end_of_turn_id]  # finish_reason length: no end
        if end is None:  # the template ends the last turn without the end-of-turn token
            end = len(full)
            if not cut:
                answer, completion_ids = answer[:-1], completion_ids[:-1]
        elif not cut:
            end += 1
        tail = full[max(end - len(answer), 0) : end]
        mismatch = self._difference(answer, tail, "answer")
        if mismatch or not num_reasoning:
            return mismatch, False
        reasoning = messages[-1].get("reasoning") or ""
        if not reasoning.strip() or not self.renders_reasoning(messages, chat_template_kwargs):
            return None, False  # the template drops this turn's reasoning: nothing to hold it to
        if full[: len(prompt_ids)] == prompt_ids:
            turn = full[len(prompt_ids) : end]
        else:
            turn = full[max(end - len(completion_ids), 0) : end]
        return self._difference(completion_ids, turn, "reasoning"), True

    def renders_reasoning(
        self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> bool:
        """Whether the template renders the last turn's reasoning: the conversation's rendering
        changes when that reasoning is left out. (Finding the reasoning's text in the rendering
        is not enough: a short trace also occurs in the turns around it.)"""
        last = {k: v for k, v in messages[-1].items() if k != "reasoning"}
        without = self.render_text([*messages[:-1], last], False, chat_template_kwargs)
        return without != self.render_text(messages, False, chat_template_kwargs)

    def _difference(self, ours: list[int], template: list[int], span: str) -> Misalignment | None:
        """Where two id sequences first differ, with the tokens from there on each side."""
        if ours == template:
            return None
        pos = next(
            (i for i, (a, b) in enumerate(zip(ours, template, strict=False)) if a != b),
            min(len(ours), len(template)),
        )

        def tokens(ids: list[int]) -> str:  # each token's text, "|" between tokens
            return "|".join(self.tokenizer.decode([i]) for i in ids[pos : pos + 4])

        return Misalignment(position=pos, ours=tokens(ours), template=tokens(template), span=span)


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


def _last_index(ids: list[int], value: int) -> int | None:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == value:
            return i
    return None
