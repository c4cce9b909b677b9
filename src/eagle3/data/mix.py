"""`eagle3 mix`: several chat / prompt sources -> one conversations.jsonl, each source's share set
by its weight.

    # 1/3 chats, 2/3 synthesized
    eagle3 mix --sources chats.jsonl=1,synth/prompts.jsonl=2 --out mixed/

Weights are relative: source i gets round(num_rows * w_i / sum(w)) rows (largest remainder, so the
counts sum to num_rows), drawn without repetition, seeded. num_rows defaults to the largest mix that
repeats no row of any source (min over sources of usable_rows_i / share_i); asking for more rows of
a source than it has is an error that names the source and the largest num_rows possible. Rows are
read with the shared reader (any format prepare reads; prompt-only rows allowed, bad rows skipped
and counted per source) and written as ``{"id": "<source index>/<id>", "messages", "category"?,
"source"}``, shuffled, for regenerate (or prepare).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.chat_formats import check_skipped, drop_reasoning, read_conversations
from eagle3.config import ConfigError, MixConfig
from eagle3.io import write_json, write_jsonl

OUTPUT = "conversations.jsonl"
MANIFEST = "manifest.json"


@dataclass
class MixResult:
    out: Path
    conversations_path: Path
    num_rows: int
    per_source: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0


def split_counts(weights: list[float], total: int) -> list[int]:
    """total split by weight, largest remainder (the counts sum to total)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def run_mix(cfg: MixConfig) -> MixResult:
    cfg.require("out")
    if not cfg.sources:
        raise ConfigError("MixConfig.sources is empty: pass --sources PATH=WEIGHT,PATH=WEIGHT")
    t0 = time.time()
    reads = [read_conversations(s.path, require_assistant=False) for s in cfg.sources]
    for i, r in enumerate(reads):
        check_skipped(
            r.source,
            r.num_rows,
            r.skipped,
            r.skip_rows,
            cfg.max_skipped_fraction,
            f"mix: sources[{i}]",
        )
    sizes = [len(r.conversations) for r in reads]
    weights = [s.weight for s in cfg.sources]
    shares = [w / sum(weights) for w in weights]
    most = min(math.floor(n / p + 1e-9) for n, p in zip(sizes, shares, strict=True))
    num_rows = cfg.num_rows or most
    counts = split_counts(weights, num_rows)
    for i, (s, n, c) in enumerate(zip(cfg.sources, sizes, counts, strict=True)):
        if c > n:
            raise ConfigError(
                f"mix: sources[{i}] ({s.path}) has {n} usable rows but weight {s.weight} of "
                f"num_rows={num_rows} asks for {c}; set num_rows <= {most} (the most without "
                "repeating rows) or lower that source's weight"
            )
    rows = _mixed_rows(cfg, reads, counts)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / OUTPUT, rows)
    per_source = [
        {
            "path": s.path,
            "weight": s.weight,
            "share": round(p, 6),
            "usable_rows": n,
            "taken": c,
            "input_rows": r.num_rows,
            "skipped": dict(r.skipped),
            "assistant_turns": dict(r.turns),
            "reasoning": s.reasoning,
            "chat_template_kwargs": s.chat_template_kwargs,
        }
        for s, p, n, c, r in zip(cfg.sources, shares, sizes, counts, reads, strict=True)
    ]
    write_json(
        out / MANIFEST,
        {
            "stage": "mix",
            "output": OUTPUT,
            "num_rows": num_rows,
            "max_rows_without_repeats": most,
            "seed": cfg.seed,
            "sources": per_source,
            "config": cfg.model_dump(mode="json"),
        },
    )
    return MixResult(out, out / OUTPUT, num_rows, per_source, round(time.time() - t0, 2))


def _mixed_rows(cfg: MixConfig, reads: list[Any], counts: list[int]) -> list[dict[str, Any]]:
    """counts[i] conversations drawn from each source without repeats (seeded), shuffled; a
    source's `reasoning: drop` and its chat_template_kwargs applied."""
    rng = random.Random(cfg.seed)
    rows = []
    for i, (s, r, c) in enumerate(zip(cfg.sources, reads, counts, strict=True)):
        for conv in rng.sample(r.conversations, c):
            messages = conv.messages
            if s.reasoning == "drop":
                messages = [drop_reasoning(m) for m in messages]
            row = {"id": f"{i}/{conv.sample_id}", "messages": messages, "source": s.path}
            if conv.category is not None:
                row["category"] = conv.category
            kwargs = conv.chat_template_kwargs
            if s.chat_template_kwargs is not None:
                kwargs = s.chat_template_kwargs
            if kwargs is not None:
                row["chat_template_kwargs"] = kwargs
            rows.append(row)
    rng.shuffle(rows)
    return rows
