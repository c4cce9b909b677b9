"""Stage 1, prepare: chat conversations -> token ids + assistant-only loss masks via the target's
own chat template.

Two ways to find the assistant tokens:
- the template has `{% generation %}` markers: transformers computes the mask
  (`return_assistant_tokens_mask=True`);
- otherwise: render growing prefixes of the conversation, check that each rendering is a prefix of
  the next (else the template is not prefix-stable and we refuse, naming the message), and mark the
  tokens whose characters fall inside an assistant turn's span. The span ends with the turn's stop
  token (the tokenizer's eos, e.g. ChatML's `<|im_end|>`): template glue after it (ChatML's newline)
  is not written by the model, so it is not supervised — as a `{% generation %}` block around
  content + stop token marks it.
Both paths give the same masks for the same template (tests/test_prepare.py checks that).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.artifacts import PreparedMeta
from eagle3.chat_formats import MAX_EXAMPLES, Conversation, check_skipped, read_conversations
from eagle3.config import ConfigError, PrepareConfig
from eagle3.io import sha256_file, sha256_text
from eagle3.prepared import save_prepared

_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(ValueError):
    """The chat template cannot give stable assistant boundaries."""


@dataclass
class PrepareResult:
    out: Path
    num_rows: int
    num_samples: int
    num_tokens: int
    num_supervised_tokens: int
    num_truncated: int
    skipped: dict[str, int] = field(default_factory=dict)
    mask_method: str = ""
    wall_s: float = 0.0


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


def load_tokenizer(target: str, trust_remote_code: bool = False):
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
            "tokenizer_config.json `auto_map`), which prepare does not run unless you opt in: set "
            "`prepare.trust_remote_code: true` in the config file (or pass --trust-remote-code) if "
            "you trust that directory"
        )
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if not getattr(tok, "chat_template", None):
        raise TemplateError(
            f"the tokenizer of {target} has no chat template; add chat_template.jinja to the "
            "target directory"
        )
    return tok


def has_generation_markers(template: str) -> bool:
    return bool(_GENERATION_RE.search(template))


def tokenize_with_generation_mask(
    tok, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def tokenize_with_prefix_mask(
    tok, messages: list[dict[str, str]], sample_id: str = "?"
) -> tuple[list[int], list[int]]:
    """Assistant spans from renderings of growing prefixes (for templates without generation
    markers)."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, msg in enumerate(messages):
        before = (
            tok.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=msg["role"] == "assistant"
            )
            if i
            else ""
        )
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        for name, text, longer in (
            (f"messages[:{i}]", before, upto),
            (f"messages[:{i + 1}]", upto, full),
        ):
            if not longer.startswith(text):
                raise TemplateError(
                    f"chat template is not prefix-stable for sample {sample_id}: the rendering of "
                    f"{name} is not a prefix of the longer conversation, so assistant boundaries "
                    "cannot be derived. Add {% generation %}...{% endgeneration %} around the "
                    "assistant content in the template."
                )
        if len(before) < prev_end:
            raise TemplateError(
                f"chat template rendering shrank at message {i} of sample {sample_id}"
            )
        if msg["role"] == "assistant":
            spans.append(
                (
                    len(before),
                    _end_at_stop_token(upto, len(before), getattr(tok, "eos_token", None)),
                )
            )
        prev_end = len(upto)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = end > start and any(s <= start and end <= e for s, e in spans)
        mask.append(1 if inside else 0)
    return ids, mask


def _end_at_stop_token(text: str, start: int, stop: str | None) -> int:
    """End of the assistant span text[start:]: just after its last stop token when only whitespace
    follows it (template glue), else the end of the text."""
    end = len(text)
    if stop:
        at = text.rfind(stop, start)
        if at >= 0 and not text[at + len(stop) :].strip():
            end = at + len(stop)
    return end


def tokenize_conversation(
    tok, conv: Conversation, use_generation: bool
) -> tuple[list[int], list[int]]:
    if use_generation:
        return tokenize_with_generation_mask(tok, conv.messages)
    return tokenize_with_prefix_mask(tok, conv.messages, conv.sample_id)


def target_vocab_size(target: str) -> int | None:
    """vocab_size of the target's config (nested text_config aware): the number of lm_head rows."""
    cfg_path = Path(target) / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    return int(cfg.get("text_config", cfg).get("vocab_size") or cfg.get("vocab_size"))


def run_prepare(cfg: PrepareConfig) -> PrepareResult:
    cfg.require("target", "data", "out")
    t0 = time.time()
    tok = load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code)
    use_generation = has_generation_markers(tok.chat_template)
    read = read_conversations(cfg.data, limit=cfg.limit, split=cfg.split, require_assistant=True)
    skipped: Counter[str] = Counter(read.skipped)
    skip_rows = {k: list(v) for k, v in read.skip_rows.items()}

    def skip(reason: str, conv: Conversation) -> None:
        skipped[reason] += 1
        if len(skip_rows.setdefault(reason, [])) < MAX_EXAMPLES:
            skip_rows[reason].append(f"sample {conv.sample_id}")

    rows: list[dict[str, Any]] = []
    seen_ids: Counter[str] = Counter()
    num_truncated = num_tokens = num_supervised = 0
    for conv in read.conversations:
        ids, mask = tokenize_conversation(tok, conv, use_generation)
        if sum(mask) == 0:
            skip("no_supervised_tokens", conv)
            continue
        if len(ids) > cfg.max_seq_len:
            ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
            num_truncated += 1
            if sum(mask) == 0:
                skip("no_supervised_tokens_after_truncation", conv)
                continue
        seen_ids[conv.sample_id] += 1
        sample_id = (
            conv.sample_id
            if seen_ids[conv.sample_id] == 1
            else f"{conv.sample_id}#{seen_ids[conv.sample_id]}"
        )
        rows.append({"input_ids": ids, "loss_mask": mask, "sample_id": sample_id})
        num_tokens += len(ids)
        num_supervised += sum(mask)
    if not rows:
        raise ValueError(
            f"no usable conversations in {cfg.data}: {read.num_rows} rows read, skipped "
            f"{dict(skipped)}"
        )
    check_skipped(
        read.source, read.num_rows, skipped, skip_rows, cfg.max_skipped_fraction, "prepare:"
    )
    data_path = Path(cfg.data)
    manifest = PreparedMeta(
        stage="prepare",
        source=str(cfg.data),
        source_sha256=sha256_file(data_path) if data_path.is_file() else None,
        target=str(cfg.target),
        tokenizer_sha256=_tokenizer_hash(cfg.target),
        chat_template_sha256=sha256_text(tok.chat_template),
        mask_method="generation_markers" if use_generation else "prefix_rendering",
        tokenizer_vocab_size=len(tok),
        target_vocab_size=target_vocab_size(cfg.target) or len(tok),
        num_rows=read.num_rows,
        num_samples=len(rows),
        num_tokens=num_tokens,
        num_supervised_tokens=num_supervised,
        num_truncated=num_truncated,
        num_duplicate_ids_renamed=sum(n - 1 for n in seen_ids.values() if n > 1),
        max_sample_len=max(len(r["input_ids"]) for r in rows),
        skipped=dict(sorted(skipped.items())),
        config=cfg.model_dump(mode="json"),
    )
    save_prepared(rows, cfg.out, manifest)
    result = PrepareResult(
        out=Path(cfg.out),
        num_rows=read.num_rows,
        num_samples=len(rows),
        num_tokens=num_tokens,
        num_supervised_tokens=num_supervised,
        num_truncated=num_truncated,
        skipped=manifest.skipped,
        mask_method=manifest.mask_method,
        wall_s=round(time.time() - t0, 3),
    )
    return result


def _tokenizer_hash(target: str) -> str | None:
    p = Path(target) / "tokenizer.json"
    return sha256_file(p) if p.is_file() else None
