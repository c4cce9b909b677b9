"""The held-out prompts of an evaluation: rendered through the target's chat template, those
that fit the engine's context kept, grouped by category."""

from __future__ import annotations

import logging

from eagle3.chat_formats import read_prompts
from eagle3.chat_template import ChatRenderer
from eagle3.config import EvaluateConfig

log = logging.getLogger("eagle3.evaluate")

#: the category of prompts whose row has none
UNCATEGORIZED = "uncategorized"


def render_prompts(
    renderer: ChatRenderer, cfg: EvaluateConfig
) -> tuple[list[list[int]], list[str], list[str], dict[str, int]]:
    """(token ids, sample ids, categories, skip counts) of the prompts that fit max_model_len -
    max_tokens, rendered with the run's (or the row's) chat_template_kwargs."""
    read = read_prompts(cfg.prompts, split=cfg.split)
    convs = read.conversations[: cfg.num_prompts]
    if len(convs) < cfg.num_prompts:
        log.warning(
            "%s: only %d usable prompts (asked for %d)", cfg.prompts, len(convs), cfg.num_prompts
        )
    ids, names, categories, skipped = [], [], [], dict(read.skipped)
    limit = cfg.max_model_len - cfg.max_tokens
    for c in convs:
        x = renderer.prompt_ids(c.messages, c.chat_template_kwargs)
        if len(x) > limit:
            skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + 1
            continue
        ids.append(x)
        names.append(c.sample_id)
        categories.append(c.category or UNCATEGORIZED)
    if not ids:
        raise ValueError(
            f"{cfg.prompts}: no prompt fits max_model_len - max_tokens = {limit} tokens; raise "
            "--max-model-len"
        )
    return ids, names, categories, skipped


def group_by_category(
    prompts: list[list[int]], categories: list[str]
) -> list[tuple[str, list[int]]]:
    """[(category, prompt indices)] in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        out.setdefault(c, []).append(i)
    return list(out.items())
