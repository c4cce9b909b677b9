"""Rollouts for `eagle3 refine`: the target's own continuations of training prompts, as a
prepared dataset.

A prompt is the start of a prepared training row: its tokens before the first supervised (answer)
token, i.e. the conversation up to its first assistant turn rendered with the chat template and its
generation prompt, exactly the tokens prepare wrote. The target continues it through the regenerate
stage's generators (vLLM, or transformers generate on hosts without vLLM:
eagle3.data.regenerate.open_generator) at each temperature, and the continuation's token ids are
kept as generated (no decode and re-encode, which can change the tokens). The rollout row is
prompt + continuation, the continuation supervised (its stop token too, as prepare marks it). That
is the text serving emits: speculative decoding emits the target's own tokens, whatever the draft
proposes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import PreparedMeta
from eagle3.io import sha256_json
from eagle3.prepared import load_prepared, save_prepared


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    ids: tuple[int, ...]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: dict[str, int] = field(default_factory=dict)  # no_answer, too_long, duplicate
    manifests: list[PreparedMeta] = field(default_factory=list)  # of the prepared datasets


def data_dirs(data: str) -> list[Path]:
    """The prepared dataset dirs of a comma-separated `data` value."""
    return [Path(x.strip()) for x in str(data).split(",") if x.strip()]


def read_prompts(data: str, max_prompt_tokens: int) -> PromptSet:
    """The distinct prompts of the prepared dataset(s) `data` (comma-separated), in order: each
    row's tokens before its first supervised token. Rows without one, or whose prompt is longer
    than max_prompt_tokens, are skipped and counted."""
    prompts: list[Prompt] = []
    seen: set[tuple[int, ...]] = set()
    skipped: Counter[str] = Counter()
    manifests = []
    for d in data_dirs(data):
        manifests.append(PreparedMeta.load(d))
        for batch in load_prepared(d).iter(batch_size=4096):
            rows = zip(batch["input_ids"], batch["loss_mask"], batch["sample_id"], strict=True)
            for ids, mask, sid in rows:
                answer = np.flatnonzero(np.asarray(mask) > 0)
                if answer.size == 0 or answer[0] == 0:
                    skipped["no_answer"] += 1
                    continue
                prompt = tuple(int(t) for t in np.asarray(ids)[: answer[0]])
                if len(prompt) > max_prompt_tokens:
                    skipped["too_long"] += 1
                elif prompt in seen:
                    skipped["duplicate"] += 1
                else:
                    seen.add(prompt)
                    prompts.append(Prompt(str(sid), prompt))
    return PromptSet(prompts, dict(skipped), manifests)


def split_prompts(
    prompts: list[Prompt], num_val: int, seed: int
) -> tuple[list[Prompt], list[Prompt]]:
    """(validation, training pool): a seeded shuffle, the first num_val prompts held out."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order[:num_val], order[num_val:]


def round_prompts(pool: list[Prompt], round_index: int, num: int) -> list[Prompt]:
    """Round r's (1-based) prompts: the pool's next `num` after the earlier rounds', wrapping
    around (never one prompt twice in a round)."""
    if not pool:
        return []
    start = (round_index - 1) * num
    return [pool[(start + i) % len(pool)] for i in range(min(num, len(pool)))]


def prompts_sha256(prompts: list[Prompt]) -> str:
    return sha256_json([[p.sample_id, list(p.ids)] for p in prompts])


@dataclass
class RolloutSettings:
    temperatures: list[float]
    top_p: float
    max_new_tokens: int
    seed: int

    def seed_of(self, temperature_index: int) -> int:
        return (self.seed * 1_000_003 + temperature_index * 7919) % (2**31)


def temperature_label(t: float) -> str:
    return f"t{t:g}"


def generate_rollouts(
    gen: Any, prompts: list[Prompt], settings: RolloutSettings, batch_size: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Prepared rows of every prompt at every temperature (input_ids = prompt + continuation,
    loss_mask on the continuation, sample_id "<temperature label>/<prompt id>") and their counts.
    `gen`: an open regenerate generator (eagle3.data.regenerate.open_generator)."""
    rows: list[dict[str, Any]] = []
    finish: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    empty = 0
    t0 = time.time()
    for ti, temp in enumerate(settings.temperatures):
        label = temperature_label(temp)
        for a in range(0, len(prompts), batch_size):
            part = prompts[a : a + batch_size]
            seed = settings.seed_of(ti) + a
            seeds = [None if temp == 0 else (seed + i) % (2**31) for i in range(len(part))]
            outs = gen.generate([list(p.ids) for p in part], seeds, temperature=temp)
            for p, (token_ids, _text, reason) in zip(part, outs, strict=True):
                finish[reason] += 1
                if not token_ids:
                    empty += 1
                    continue
                tokens[label] += len(token_ids)
                rows.append(
                    {
                        "input_ids": list(p.ids) + list(token_ids),
                        "loss_mask": [0] * len(p.ids) + [1] * len(token_ids),
                        "sample_id": f"{label}/{p.sample_id}",
                    }
                )
    generated, wall = sum(tokens.values()), time.time() - t0
    stats = {
        "num_rollouts": len(rows),
        "generated_tokens": generated,
        "finish_reasons": dict(finish),
        "empty": empty,
        "tokens_per_temperature": dict(tokens),
        "generate_s": round(wall, 2),
        "generated_tokens_per_s": round(generated / max(wall, 1e-9), 1),
    }
    return rows, stats


def write_rollouts(
    rows: list[dict[str, Any]],
    out: Path,
    source_manifests: list[PreparedMeta],
    manifest: dict[str, Any],
) -> Path:
    """The rollouts as a prepared dataset (eagle3.prepared) that capture reads; the manifest
    carries the tokenizer and chat template hashes of the source data, as prepare's does."""
    first = source_manifests[0] if source_manifests else None
    full = {
        "stage": "refine-rollouts",
        "tokenizer_sha256": first.tokenizer_sha256 if first else None,
        "chat_template_sha256": first.chat_template_sha256 if first else None,
        "target_vocab_size": first.target_vocab_size if first else None,
        "num_samples": len(rows),
        "num_tokens": sum(len(r["input_ids"]) for r in rows),
        "num_supervised_tokens": sum(sum(r["loss_mask"]) for r in rows),
        "max_sample_len": max((len(r["input_ids"]) for r in rows), default=0),
        **manifest,
    }
    return save_prepared(rows, out, PreparedMeta.from_dict(full, str(out / PreparedMeta.FILE)))
