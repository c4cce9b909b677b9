"""The chat-data reader shared by prepare, regenerate and evaluate.

Inputs: a `.json` file (a list of rows; a file that is really JSON Lines is read as such), a
`.jsonl` file, a `.parquet`/`.csv` file, a local HF `datasets` directory (`save_to_disk` output: a
Dataset or a DatasetDict, from which `split` is taken, or a directory of data files that
`load_dataset` reads), or an in-memory `datasets.Dataset`/`DatasetDict`/list of dicts.

Row formats (detected per row):

* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value":
  "..."}]}`` (`from`: human/user -> user; gpt/assistant/chatgpt/bing/bard/model/bot -> assistant;
  system). Turns that use `role`/`content` inside `conversations` are accepted too.
* OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (content may be a list of
  ``{"type": "text", "text": ...}`` parts; `developer` is read as `system`).
* Pairs: `question`/`answer`, `prompt`/`response`, `prompt`/`completion`, `instruction`/`output`
  (an Alpaca `input` is appended to the instruction) -> one user turn + one assistant turn.
  With ``require_assistant=False`` a pair row may lack its answer (prompt-only rows: regenerate and
  evaluate need only the prompts).

`sample_id` is the row's `id` (or `sample_id`) field, else ``row-<index>`` (0-based row index).

A bad row is skipped and counted under one reason (``ReadResult.skipped``), with the first few
examples kept in ``ReadResult.skip_examples`` and logged: ``missing_fields``, ``not_a_mapping``,
``unknown_role``, ``empty_content``, ``no_user_turn``, ``no_assistant_turn``, ``invalid_json``
(a JSONL line that does not parse; the warning names the file and line number), ``invalid_utf8`` (a
JSONL line that is not UTF-8: the line is skipped, the rest of the file is read). No usable row at
all is a ValueError naming the input.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import DataLossError, UserError

#: the think block of thinking models (Kimi-K2, Qwen3, DeepSeek-R1/V3.1, GLM, MiniMax)
THINK_START = "<think>"
THINK_END = "</think>"

log = logging.getLogger(__name__)

BOM = b"\xef\xbb\xbf"

ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
}

#: (prompt key, answer key) pairs, tried in order.
PAIR_KEYS = (
    ("question", "answer"),
    ("prompt", "response"),
    ("prompt", "completion"),
    ("instruction", "output"),
)

SKIP_REASONS = (
    "invalid_json",
    "bad_token_ids",
    "invalid_utf8",
    "not_a_mapping",
    "missing_fields",
    "unknown_role",
    "empty_content",
    "no_user_turn",
    "no_assistant_turn",
)

#: examples kept (and logged) per skip reason
MAX_EXAMPLES = 5

FORMAT_HELP = (
    "expected rows with `conversations: [{from, value}]` (ShareGPT), `messages: [{role, content}]` "
    "(OpenAI) or `question`/`answer`, `prompt`/`response`, `prompt`/`completion`, "
    "`instruction`/`output` pairs"
)


@dataclass
class Conversation:
    sample_id: str
    #: [{"role": "system"|"user"|"assistant", "content": str}, ...]; an assistant turn may also
    #: hold `reasoning` (its trace), `token_ids` (the ids the target generated), `prompt_token_ids`
    #: (the ids the engine saw) and `finish_reason` (READ_TURN_KEYS)
    messages: list[dict[str, Any]]
    #: the row's optional `category` (e.g. a domain: math, coding, ...); evaluate reports τ per
    #: category
    category: str | None = None
    #: the row's own `chat_template_kwargs` (its source's thinking switch); None: the run's
    chat_template_kwargs: dict[str, Any] | None = None
    #: the row's `source` (the file `eagle3 mix` took it from), for per-source figures
    source: str | None = None


@dataclass
class ReadResult:
    conversations: list[Conversation]
    #: skip reason -> number of rows skipped for it
    skipped: Counter = field(default_factory=Counter)
    #: rows looked at (usable + skipped)
    num_rows: int = 0
    #: the input, as given
    source: str = ""
    #: row format -> number of usable rows in it (sharegpt, openai, pair, prompt)
    formats: Counter = field(default_factory=Counter)
    #: skip reason -> first few "row N: what was wrong" strings
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    #: skip reason -> where the first few skipped rows are ("line 4" of a JSONL file, "row 3"
    #: (0-based) otherwise)
    skip_rows: dict[str, list[str]] = field(default_factory=dict)
    #: what the assistant turns carry: reasoning_field (`reasoning_content`/`reasoning`),
    #: inline_think (`<think>...</think>` in the content), token_ids (the ids the target
    #: generated), text_only (none of those)
    turns: Counter = field(default_factory=Counter)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_rows": self.num_rows,
            "num_conversations": len(self.conversations),
            "skipped": dict(self.skipped),
            "formats": dict(self.formats),
            "assistant_turns": dict(self.turns),
        }


class _RowError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------------------------- rows
def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise _RowError(
                    "missing_fields", f"{where}: content part {part!r:.80} has no `text`"
                )
        return "\n".join(
            parts
        )  # as vLLM's chat renderer joins text parts: training sees what serving renders
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise _RowError(
        "missing_fields", f"{where}: content must be a string, got {type(value).__name__}"
    )


def _turns(turns: Any, role_key: str, content_key: str, column: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise _RowError(
            "missing_fields", f"`{column}` must be a list of turns, got {type(turns).__name__}"
        )
    messages = []
    for j, turn in enumerate(turns):
        where = f"{column}[{j}]"
        if not isinstance(turn, dict):
            raise _RowError("not_a_mapping", f"{where} is a {type(turn).__name__}, not a mapping")
        rk, ck = role_key, content_key
        if rk not in turn and "role" in turn:  # ShareGPT rows written with role/content
            rk, ck = "role", "content"
        elif rk not in turn and "from" in turn:
            rk, ck = "from", "value"
        if rk not in turn or ck not in turn:
            raise _RowError(
                "missing_fields", f"{where} lacks `{rk}` or `{ck}` (keys: {sorted(turn)})"
            )
        raw_role = turn[rk]
        role = ROLE_ALIASES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            raise _RowError(
                "unknown_role",
                f"{where}.{rk} = {raw_role!r} is not a known role (use one of "
                f"{sorted(ROLE_ALIASES)})",
            )
        message: dict[str, Any] = {"role": role, "content": _content(turn[ck], where)}
        if role == "assistant":
            _assistant_extras(turn, message, where)
        messages.append(message)
    return messages


#: an assistant turn's keys kept beside role and content
READ_TURN_KEYS = ("reasoning", "token_ids", "prompt_token_ids", "finish_reason")


def _assistant_extras(turn: dict[str, Any], message: dict[str, Any], where: str) -> None:
    """An assistant turn's reasoning (`reasoning_content`, `reasoning`, or an inline
    `<think>...</think>` opening its content: split off whole, the text on either side kept
    to the character), and the ids the target generated with the prompt ids it saw."""
    for key in ("reasoning_content", "reasoning"):
        value = turn.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _RowError(
                    "missing_fields", f"{where}.{key} must be a string, got {type(value).__name__}"
                )
            message["reasoning"] = value
            break
    content = message["content"]
    if "reasoning" not in message and THINK_END in content:
        head, _, answer = content.partition(THINK_END)
        opened = head.lstrip().startswith(THINK_START)
        if opened or THINK_START not in head:  # `<think>R</think>A`, or `R</think>A` (R1)
            message["reasoning"] = head.lstrip().removeprefix(THINK_START) if opened else head
            message["content"] = answer
            message["inline_think"] = True
    for key in ("token_ids", "prompt_token_ids"):
        ids = turn.get(key)
        if ids is None:
            continue
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise _RowError(
                "bad_token_ids", f"{where}.{key} must be a list of token ids (integers >= 0)"
            )
        message[key] = ids
    if "prompt_token_ids" in message and "token_ids" not in message:
        raise _RowError(
            "bad_token_ids", f"{where} has prompt_token_ids but no token_ids (the answer's ids)"
        )
    if isinstance(turn.get("finish_reason"), str):
        message["finish_reason"] = turn["finish_reason"]


def _pair(row: dict[str, Any], require_assistant: bool) -> tuple[list[dict[str, str]], str]:
    for pk, ak in PAIR_KEYS:
        if pk in row and ak in row and row[ak] is not None:
            prompt = _content(row[pk], f"`{pk}`")
            if pk == "instruction" and row.get("input"):
                prompt = f"{prompt}\n\n{_content(row['input'], '`input`')}"
            return [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": _content(row[ak], f"`{ak}`")},
            ], "pair"
    if not require_assistant:
        for pk in ("question", "prompt", "instruction"):
            if pk in row and row[pk] is not None:
                prompt = _content(row[pk], f"`{pk}`")
                if pk == "instruction" and row.get("input"):
                    prompt = f"{prompt}\n\n{_content(row['input'], '`input`')}"
                return [{"role": "user", "content": prompt}], "prompt"
    present = [k for k in ("question", "prompt", "instruction") if k in row]
    if present and require_assistant:
        raise _RowError(
            "no_assistant_turn",
            f"has `{present[0]}` but no answer field (`answer`/`response`/`completion`/`output`)",
        )
    raise _RowError(
        "missing_fields",
        f"no `conversations`, `messages` or prompt/answer fields (keys: {sorted(row)[:12]})",
    )


def parse_row(row: Any, index: int, require_assistant: bool = True) -> tuple[Conversation, str]:
    """One input row -> (Conversation, format name). Raises _RowError(reason, detail) for a bad
    row."""
    if not isinstance(row, dict):
        raise _RowError("not_a_mapping", f"row is a {type(row).__name__}, not a mapping")
    if row.get("messages") is not None:
        messages, fmt = _turns(row["messages"], "role", "content", "messages"), "openai"
    elif row.get("conversations") is not None:
        messages, fmt = _turns(row["conversations"], "from", "value", "conversations"), "sharegpt"
    else:
        messages, fmt = _pair(row, require_assistant)
    if not messages:
        raise _RowError(
            "missing_fields", f"`{'messages' if fmt == 'openai' else 'conversations'}` is empty"
        )
    for j, m in enumerate(messages):
        said = m["content"].strip() or (m.get("reasoning") or "").strip() or m.get("token_ids")
        if not said and (m["role"] != "assistant" or require_assistant):
            raise _RowError("empty_content", f"turn {j} ({m['role']}) has empty content")
    if not any(m["role"] == "user" for m in messages):
        raise _RowError("no_user_turn", "has no user turn")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise _RowError("no_assistant_turn", "has no assistant turn")
    sid = row.get("id", row.get("sample_id"))
    sample_id = str(sid) if sid not in (None, "") else f"row-{index}"
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise _RowError("bad_category", f"`category` is a {type(category).__name__}, not a string")
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _RowError(
            "missing_fields",
            f"`chat_template_kwargs` is a {type(kwargs).__name__}, not a mapping",
        )
    conv = Conversation(
        sample_id=sample_id,
        messages=messages,
        category=category or None,
        chat_template_kwargs=kwargs,
        source=row["source"] if isinstance(row.get("source"), str) else None,
    )
    return conv, fmt


def turn_kinds(messages: list[dict[str, Any]]) -> Counter:
    """What each assistant turn carries (ReadResult.turns)."""
    kinds: Counter = Counter()
    for m in messages:
        if m["role"] != "assistant":
            continue
        if "token_ids" in m:
            kinds["token_ids"] += 1
        if m.pop("inline_think", False):
            kinds["inline_think"] += 1
        elif "reasoning" in m:
            kinds["reasoning_field"] += 1
        if "token_ids" not in m and "reasoning" not in m:
            kinds["text_only"] += 1
    return kinds


# -------------------------------------------------------------------------------------------- input
def _iter_jsonl(path: Path) -> Iterator[Any]:
    """Yield parsed rows; an unparsable or non-UTF-8 line yields an _InvalidLine (counted by the
    caller)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(BOM)  # a UTF-8 byte order mark is not part of row 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield _InvalidLine(
                    lineno,
                    f"not valid UTF-8 (byte {e.start} of the line: {raw[e.start : e.start + 4]!r})",
                    "invalid_utf8",
                )
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield _InvalidLine(lineno, f"invalid JSON ({e})")


@dataclass
class _InvalidLine:
    lineno: int
    error: str
    reason: str = "invalid_json"


def _load_rows(src: Any, split: str) -> tuple[Iterable[Any], str]:
    """-> (rows, description of the input)."""
    if isinstance(src, list):
        return src, f"<list of {len(src)} rows>"
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(src, datasets.DatasetDict):
        return _pick_split(src, split, "<DatasetDict>"), f"<DatasetDict split {split}>"
    if datasets is not None and isinstance(src, datasets.Dataset):
        return src, f"<Dataset of {len(src)} rows>"
    path = Path(src)
    name = str(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: pass a .json/.jsonl file or a local HF datasets directory"
        )
    if path.is_dir():
        return _load_directory(path, split), name
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        array = _json_array(path)
        return (_JSONL(path), name) if array is None else (array, name)
    if suffix == ".json":
        return _load_json(path), name
    if suffix in (".parquet", ".csv"):
        import datasets as ds_mod

        return ds_mod.load_dataset(suffix[1:], data_files=str(path), split="train"), name
    raise ValueError(
        f"{path}: unsupported input type {suffix!r}; use a .json (list of rows) or .jsonl file, "
        ".parquet/.csv, or a local HF datasets directory"
    )


def _load_directory(path: Path, split: str) -> Any:
    """A local HF datasets directory: one `save_to_disk` wrote, or data files `load_dataset`
    reads (its `split`)."""
    import datasets as ds_mod

    name = str(path)
    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    if saved or ((path / "dataset_info.json").is_file() and any(path.glob("*.arrow"))):
        loaded = ds_mod.load_from_disk(str(path))
        if isinstance(loaded, ds_mod.DatasetDict):
            return _pick_split(loaded, split, name)
        return loaded
    try:
        return ds_mod.load_dataset(str(path), split=split)
    except ValueError as e:
        raise ValueError(
            f"{path}: could not load split {split!r} with datasets.load_dataset: {e}"
        ) from None
    except FileNotFoundError as e:
        raise ValueError(
            f"{path} is a directory but neither a `save_to_disk` dataset nor a directory of "
            f"data files datasets can read ({e})"
        ) from None


def _load_json(path: Path) -> Any:
    """The rows of a .json file: its list, the one list of rows a wrapper object holds, or the
    object itself as one row; JSON Lines saved as .json is read as such."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}: not valid UTF-8 at line {line} (byte {e.start} of the file); a .json "
            "file is parsed as a whole, so fix or re-encode it, or save it as JSON Lines "
            "(.jsonl), where a bad line is skipped and counted"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if "Extra data" in str(e):  # JSON Lines saved as .json
            return _JSONL(path)
        raise ValueError(
            f"{path} is not valid JSON ({e}): fix the file or save it as JSON Lines (.jsonl)"
        ) from None
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if len(lists) == 1 and not ({"messages", "conversations"} & set(data)):
            return data[lists[0]]  # {"data": [...]} wrapper
        return [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: top level must be a list of rows, got {type(data).__name__}")
    return data


def _json_array(path: Path) -> list[Any] | None:
    """The rows of a `.jsonl` file that holds one JSON array (a pretty-printed `.json` saved as
    `.jsonl`: read line by line it would lose every row but the last), or None when it is JSON
    Lines. An array that does not parse is refused with a hint: skipping its lines would drop the
    whole file."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    if not head.startswith(b"["):
        return None
    raw = path.read_bytes().removeprefix(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path}: one JSON array (it starts with `[`) that is not valid UTF-8 "
            f"at line {line}: fix or re-encode it, or write one row per line (JSON "
            "Lines), where a bad line is skipped and counted"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # `[...]` then more lines: JSON Lines after all
        if "Extra data" in str(e) and "\n" in text.strip():
            return None
        raise UserError(
            f"{path} starts with `[`, so it is read as one JSON array (JSON Lines has one row "
            f"per line), but it is not valid JSON ({e}): fix the array, or write one row per line "
            "(JSON Lines)"
        ) from None
    if not isinstance(data, list):
        return None
    log.info(
        "%s holds one JSON array of %d rows: read as such (not as JSON Lines)", path, len(data)
    )
    return data


def _pick_split(dd: Any, split: str, name: str) -> Any:
    if split not in dd:
        raise ValueError(
            f"{name}: DatasetDict has no split {split!r}; pass --split with one of {sorted(dd)}"
        )
    return dd[split]


@dataclass
class _JSONL:
    path: Path


def read_conversations(
    path_or_dataset: str | Path | Any,
    limit: int | None = None,
    split: str = "train",
    require_assistant: bool = True,
) -> ReadResult:
    """Read chat data in any supported format -> ReadResult (usable conversations + skip counts).

    `limit` bounds the number of input rows looked at (skipped rows count towards it).
    """
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    formats: Counter = Counter()
    turns: Counter = Counter()
    rows, source = _load_rows(path_or_dataset, split)
    what = "line" if isinstance(rows, _JSONL) else "row"
    if isinstance(rows, _JSONL):
        rows = _iter_jsonl(rows.path)
    skips = _Skips(source)
    convs: list[Conversation] = []
    num_rows = 0
    for index, row in enumerate(rows):
        if limit is not None and num_rows >= limit:
            break
        num_rows += 1
        if isinstance(row, _InvalidLine):
            skips.add(row.reason, f"line {row.lineno}", row.error)
            continue
        try:
            conv, fmt = parse_row(row, index, require_assistant=require_assistant)
        except _RowError as e:
            skips.add(e.reason, f"line {index + 1}" if what == "line" else f"row {index}", e.detail)
            continue
        formats[fmt] += 1
        turns.update(turn_kinds(conv.messages))
        convs.append(conv)
    if not convs:
        raise skips.nothing_usable(num_rows, require_assistant)
    if skips.skipped:
        log.warning(
            "%s: skipped %d of %d rows: %s",
            source,
            sum(skips.skipped.values()),
            num_rows,
            dict(skips.skipped),
        )
    return ReadResult(
        conversations=convs,
        skipped=skips.skipped,
        num_rows=num_rows,
        source=source,
        formats=formats,
        skip_examples=skips.examples,
        skip_rows=skips.where,
        turns=turns,
    )


@dataclass
class _Skips:
    """The rows of `source` skipped: counts per reason, and the first few of each (logged)."""

    source: str
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # "loc: detail" per reason
    where: dict[str, list[str]] = field(default_factory=dict)  # their locations

    def add(self, reason: str, loc: str, detail: str) -> None:
        self.skipped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(f"{loc}: {detail}")
            self.where.setdefault(reason, []).append(loc)
            log.warning("%s: %s: %s skipped (%s)", self.source, loc, detail, reason)

    def nothing_usable(self, num_rows: int, require_assistant: bool) -> ValueError:
        """The error when no row of `num_rows` was usable: the reasons, one example, the formats
        read."""
        detail = ", ".join(f"{k}={v}" for k, v in self.skipped.items()) or "the input is empty"
        first = next((ex[0] for ex in self.examples.values() if ex), "")
        return ValueError(
            f"{self.source}: no usable conversations in {num_rows} rows "
            f"({detail}){'; e.g. ' + first if first else ''}. "
            + FORMAT_HELP
            + ("" if require_assistant else " (prompt-only rows allowed)")
        )


def drop_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn as its answer alone: reasoning and the generated ids (which hold the
    reasoning) left out."""
    return {k: v for k, v in message.items() if k not in READ_TURN_KEYS}


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The turns before the first assistant turn (all of them when there is none)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def read_prompts(
    path_or_dataset: str | Path | Any, limit: int | None = None, split: str = "train"
) -> ReadResult:
    """Like read_conversations(require_assistant=False), each conversation cut to its first prompt
    (`prompt_messages`). A prompt without a user turn (e.g. the data starts with an assistant turn)
    is skipped as ``no_user_turn``."""
    res = read_conversations(path_or_dataset, limit=limit, split=split, require_assistant=False)
    kept = []
    for c in res.conversations:
        msgs = prompt_messages(c.messages)
        if not any(m["role"] == "user" for m in msgs):
            res.skipped["no_user_turn"] += 1
            res.skip_examples.setdefault("no_user_turn", []).append(
                f"{c.sample_id}: an assistant turn comes before any user turn"
            )
            res.skip_rows.setdefault("no_user_turn", []).append(f"sample {c.sample_id}")
            continue
        kept.append(
            Conversation(
                sample_id=c.sample_id,
                messages=msgs,
                category=c.category,
                chat_template_kwargs=c.chat_template_kwargs,
                source=c.source,
            )
        )
    if not kept:
        raise ValueError(
            f"{res.source}: no usable prompts (skipped: {dict(res.skipped)}). {FORMAT_HELP}"
        )
    res.conversations = kept
    return res


def iter_prompts(
    path_or_dataset: str | Path | Any, limit: int | None = None, split: str = "train"
) -> Iterator[Conversation]:
    """Yield each usable row's prompt: its messages up to (not including) the first assistant
    turn."""
    yield from read_prompts(path_or_dataset, limit=limit, split=split).conversations


def _where(locations: list[str], count: int) -> str:
    """["line 4", "line 8"] -> "lines 4, 8" (", ..." when more rows were skipped than listed)."""
    units = {loc.split(" ", 1)[0] for loc in locations}
    if len(units) == 1 and all(" " in loc for loc in locations):
        text = f"{units.pop()}s " + ", ".join(loc.split(" ", 1)[1] for loc in locations)
    else:
        text = ", ".join(locations)
    return text + (", ..." if count > len(locations) else "")


def check_skipped(
    source: str,
    num_rows: int,
    skipped: dict[str, int],
    skip_rows: dict[str, list[str]],
    max_fraction: float,
    what: str = "",
) -> None:
    """Raise DataLossError when more than `max_fraction` of the `num_rows` input rows of `source`
    were skipped: the reasons by count with the first rows of each, and the two fixes (the rows, or
    the limit). `what` prefixes the input's name (e.g. "mix: sources[1]")."""
    num_skipped = sum(skipped.values())
    if not num_rows or num_skipped <= max_fraction * num_rows:
        return
    frac = num_skipped / num_rows
    reasons = ", ".join(
        f"{reason} {n}" + (f" ({_where(skip_rows[reason], n)})" if skip_rows.get(reason) else "")
        for reason, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))
        if n
    )
    raise DataLossError(
        f"{what + ' ' if what else ''}{source}: {num_skipped} of {num_rows} input rows "
        f"({frac:.1%}) were skipped, more than max_skipped_fraction = {max_fraction:g} allows: "
        f"{reasons}. Fix those rows (the log names each one's problem; {FORMAT_HELP}), or accept "
        f"the loss with --max-skipped-fraction {_ceil(frac)} (`max_skipped_fraction:` in the "
        "config file)"
    )


def _ceil(frac: float) -> str:
    """The smallest 3-decimal fraction >= frac, as text (0.125 -> "0.125", 0.1234 -> "0.124")."""
    return f"{math.ceil(frac * 1000 - 1e-9) / 1000:g}"
