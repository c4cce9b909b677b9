"""`eagle3 synthesize`: user prompts the target writes itself (Magpie-style), for training data from
nothing but it.

The target's chat template is rendered up to the start of a user turn (ChatML:
``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n``) and the target, sampled,
writes the user's message until it ends the turn. Each domain (coding, writing, math, ... ;
`SynthesizeConfig.domains`) steers it with its own system prompt describing the users to expect, and
optionally seed phrases the message starts with. `regenerate` then writes the target's answers to
these prompts: on-policy, broad data.

    prefix = user_turn_prefix(tokenizer, system)   # template text up to the user's content
    stop   = end_of_user_turn(tokenizer)           # the token after the user's content

Every generated message goes through, in order (the first that fails names the drop reason, counted
per domain in manifest.json): `truncated` (hit max_new_tokens without ending the turn), `empty`,
`too_short` / `too_long` (min_chars / max_chars), `non_text` (U+FFFD, or too few letters),
`repetitive` (repeated word 3-grams), `duplicate` (same normalised text as a kept message),
`near_duplicate` (character 5-gram Jaccard >= near_duplicate_jaccard with a kept message; MinHash
LSH finds the candidates, the Jaccard is then exact). Every generated message is accounted for: kept
+ dropped (by reason) + surplus (generated in a round after its domain's quota was met, not looked
  at) = generated. Generation runs in rounds until every domain has its share of num_prompts or
  max_attempts_factor x num_prompts
messages were generated; a shortfall is reported, never hidden.

Output (in `out`): `prompts.jsonl` (rows ``{"id", "messages": [{"role": "user", "content"}],
"category"}``, which regenerate, prepare and evaluate read) and `manifest.json`. Both are written
under temp names and renamed; a rerun with the same settings finds them and does nothing, other
settings in the same `out` are refused.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.config import SynthesizeConfig
from eagle3.data.generate_hf import HfGenerator
from eagle3.io import atomic_path, read_json, sha256_file, sha256_json, write_json
from eagle3.lock import dir_lock, record_engine_processes
from eagle3.vllm_engine import engine_kwargs, setup_cpu_env

log = logging.getLogger(__name__)

OUTPUT = "prompts.jsonl"
MANIFEST = "manifest.json"
DROP_REASONS = (
    "truncated",
    "empty",
    "too_short",
    "too_long",
    "non_text",
    "repetitive",
    "duplicate",
    "near_duplicate",
)
# text no template produces, to find where the user's content goes
_SENTINEL = "\u2063EAGLE3_USER_MESSAGE\u2063"


@dataclass
class SynthesizeResult:
    out: Path
    prompts_path: Path
    num_prompts: int
    per_domain: dict[str, int]
    dropped: dict[str, int]
    num_generated: int
    elapsed_s: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ chat template


def _render(tok: Any, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def _split_at_user(tok: Any, system: str | None) -> tuple[str, str]:
    """(template text before the user's content, text after it) for [system?, user]."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = _render(tok, messages)
    if text.count(_SENTINEL) != 1:
        raise ValueError(
            f"the chat template renders the user's content {text.count(_SENTINEL)} times (expected "
            "once); synthesize needs a template that places a user message once"
        )
    before, after = text.split(_SENTINEL)
    if system is not None and system not in before:
        raise ValueError(
            "the chat template drops the system message, so the domain's system prompt cannot "
            "steer the target; steer the domains with `seeds` instead and set their `system` to "
            "null"
        )
    return before, after


def user_turn_prefix(tok: Any, system: str | None = None) -> str:
    """The chat template rendered up to where the user's first message begins (system turn included:
    `system`, or the template's default when None). ChatML:
    '<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n'."""
    return _split_at_user(tok, system)[0]


def end_of_user_turn(tok: Any) -> int:
    """The token id the template puts right after the user's content (ChatML <|im_end|>, Llama 3
    <|eot_id|>): where the target ends the message it writes. It must be a special token, else the
    end is ambiguous."""
    after = _split_at_user(tok, None)[1]
    ids = tok(after, add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids) | {
        i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special
    }
    if not ids or ids[0] not in special:
        raise ValueError(
            f"the chat template ends a user turn with {after[:20]!r}, which does not start with a "
            "special token; synthesize stops the target's message at that token, so the template "
            "must end user turns with one"
        )
    return ids[0]


# ------------------------------------------------------------------------------------------ filters


def normalize(text: str) -> str:
    """Lower case, runs of non-alphanumerics -> one space: the key of exact deduplication."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def repeated_fraction(text: str, n: int = 3) -> float:
    """Fraction of word n-grams that repeat an earlier one (0 for texts under 2n words)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(words) < 2 * n:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def letter_fraction(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / max(len(chars), 1)


def check_text(text: str, finish_reason: str, cfg: SynthesizeConfig) -> str | None:
    """The drop reason of one generated message before deduplication, or None to keep it."""
    if finish_reason != "stop":
        return "truncated"
    if not text:
        return "empty"
    if len(text) < cfg.min_chars:
        return "too_short"
    if len(text) > cfg.max_chars:
        return "too_long"
    if "\ufffd" in text or letter_fraction(text) < cfg.min_letter_fraction:
        return "non_text"
    if repeated_fraction(text) > cfg.max_repeated_fraction:
        return "repetitive"
    return None


class NearDuplicateIndex:
    """Character 5-gram shingles of the normalised text; MinHash (num_perm hashes, `bands` LSH
    bands) proposes candidates, whose exact Jaccard decides. Deterministic (crc32 shingle hashes,
    seeded permutations)."""

    PRIME = 4294967311  # > 2**32

    def __init__(
        self, threshold: float, seed: int = 0, num_perm: int = 64, bands: int = 16, k: int = 5
    ):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**31, num_perm, dtype=np.uint64)  # (P,)
        self.b = rng.integers(0, 2**32, num_perm, dtype=np.uint64)  # (P,)
        self.threshold, self.bands, self.k = threshold, bands, k
        self.rows = num_perm // bands
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.shingles: list[set[str]] = []

    def _shingles(self, norm: str) -> set[str]:
        return {norm[i : i + self.k] for i in range(max(len(norm) - self.k + 1, 1))}

    def _bands(self, sh: set[str]) -> list[tuple[int, bytes]]:
        h = np.array([zlib.crc32(s.encode()) for s in sh], dtype=np.uint64)  # (S,)
        sig = ((self.a[:, None] * h[None, :] + self.b[:, None]) % np.uint64(self.PRIME)).min(
            axis=1
        )  # (P,)
        return [(i, sig[i * self.rows : (i + 1) * self.rows].tobytes()) for i in range(self.bands)]

    def _has_near_duplicate(self, sh: set[str], keys: list[tuple[int, bytes]]) -> bool:
        for j in {j for key in keys for j in self.buckets.get(key, ())}:
            other = self.shingles[j]
            if len(sh & other) / len(sh | other) >= self.threshold:
                return True
        return False

    def contains(self, norm: str) -> bool:
        """True when a near-duplicate of `norm` is indexed (`norm` itself is not added)."""
        sh = self._shingles(norm)
        return self._has_near_duplicate(sh, self._bands(sh))

    def add_if_new(self, norm: str) -> bool:
        """Index `norm` and return True, or return False when a near-duplicate is already
        indexed."""
        sh = self._shingles(norm)
        keys = self._bands(sh)
        if self._has_near_duplicate(sh, keys):
            return False
        self.shingles.append(sh)
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.shingles) - 1)
        return True


# ----------------------------------------------------------------------------------------- backends


class _VllmBackend:
    def __init__(self, cfg: SynthesizeConfig, llm: Any):
        self.cfg = cfg
        self.engine = engine_kwargs(
            cfg.target,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=cfg.seed,
            enable_prefix_caching=True,  # every prompt of a domain shares its prefix
            trust_remote_code=cfg.trust_remote_code,
        )
        if llm is None:
            setup_cpu_env()
            from vllm import LLM

            llm = LLM(**self.engine)
            record_engine_processes()
        self.llm = llm

    def generate(
        self, prompts: list[list[int]], seeds: list[int], stop_id: int
    ) -> list[tuple[list[int], str]]:
        from vllm import SamplingParams

        c = self.cfg
        params = [
            SamplingParams(
                temperature=c.temperature,
                top_p=c.top_p,
                max_tokens=c.max_new_tokens,
                seed=s,
                stop_token_ids=[stop_id],
            )
            for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            (
                list(o.outputs[0].token_ids),
                "stop" if o.outputs[0].finish_reason == "stop" else "length",
            )
            for o in outs
        ]


class _HfBackend:
    def __init__(self, cfg: SynthesizeConfig):
        self.cfg = cfg
        self.gen = HfGenerator(
            str(cfg.target), device=cfg.device, dtype=cfg.dtype, batch_size=cfg.batch_size
        )
        self.engine = {
            "backend": "hf",
            "device": self.gen.device,
            "dtype": str(self.gen.model.dtype).removeprefix("torch."),
            "batch_size": cfg.batch_size,
        }

    def generate(
        self, prompts: list[list[int]], seeds: list[int], stop_id: int
    ) -> list[tuple[list[int], str]]:
        c = self.cfg
        outs = self.gen.generate(
            prompts,
            c.max_new_tokens,
            c.temperature,
            c.top_p,
            seed=seeds[0] if seeds else 0,
            stop_ids={stop_id},
        )
        return [(g.token_ids, g.finish_reason) for g in outs]


# -------------------------------------------------------------------------------------------- stage


def domain_quotas(cfg: SynthesizeConfig) -> dict[str, int]:
    """num_prompts split by domain weight (largest remainder, so the quotas sum to num_prompts)."""
    total = sum(d.weight for d in cfg.domains.values())
    exact = {name: cfg.num_prompts * d.weight / total for name, d in cfg.domains.items()}
    quota = {name: math.floor(x) for name, x in exact.items()}
    for name in sorted(exact, key=lambda n: quota[n] - exact[n])[
        : cfg.num_prompts - sum(quota.values())
    ]:
        quota[name] += 1
    return quota


def _fingerprint(cfg: SynthesizeConfig) -> str:
    d = cfg.model_dump(mode="json", exclude={"enabled", "out", "stage"})
    return sha256_json(d)


def run_synthesize(cfg: SynthesizeConfig, llm: Any = None) -> SynthesizeResult:
    """See `_synthesize`; one writer per out dir (eagle3.lock), which also records the engine's
    processes."""
    cfg.require("target", "out")
    with dir_lock(cfg.out, "synthesize out"):
        return _synthesize(cfg, llm)


def _synthesize(cfg: SynthesizeConfig, llm: Any = None) -> SynthesizeResult:
    """Write `cfg.num_prompts` user prompts with `cfg.target` (see the module docstring). `llm`: an
    existing `vllm.LLM` of the target to reuse (tests, notebooks)."""
    from transformers import AutoTokenizer

    cfg.require("target", "out")
    t0 = time.time()
    out = Path(cfg.out)
    fp = _fingerprint(cfg)
    if (out / MANIFEST).is_file() and (out / OUTPUT).is_file():
        manifest = read_json(out / MANIFEST)
        if manifest.get("fingerprint") == fp:
            log.info("%s is complete for these settings; nothing to do", out / OUTPUT)
            return _result(out, manifest, time.time() - t0)
        raise ValueError(
            f"{out} already holds prompts synthesized with other settings; pass a new --out or "
            "delete it"
        )

    tok = AutoTokenizer.from_pretrained(str(cfg.target), trust_remote_code=cfg.trust_remote_code)
    if not tok.chat_template:
        raise ValueError(
            f"target={cfg.target}: the tokenizer has no chat template; synthesize renders the "
            "start of a user turn with it"
        )
    stop_id = end_of_user_turn(tok)
    names = list(cfg.domains)
    prefixes = {n: user_turn_prefix(tok, cfg.domains[n].system) for n in names}
    quota = domain_quotas(cfg)
    backend: Any = _HfBackend(cfg) if cfg.backend == "hf" else _VllmBackend(cfg, llm)

    rng = random.Random(cfg.seed)
    near = (
        NearDuplicateIndex(cfg.near_duplicate_jaccard, seed=cfg.seed)
        if cfg.near_duplicate_jaccard < 1
        else None
    )
    exact: set[str] = set()
    kept: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    generated, surplus = (
        Counter(),
        Counter(),
    )  # surplus: valid or not, generated after the domain's quota was met
    dropped: dict[str, Counter] = {n: Counter() for n in names}
    tokens = 0
    budget = math.ceil(cfg.max_attempts_factor * cfg.num_prompts)
    gen_t0, rounds = time.time(), 0
    while sum(generated.values()) < budget:
        jobs: list[str] = []
        for n in names:
            need = quota[n] - len(kept[n])
            if need > 0:
                rate = (len(kept[n]) + 1) / (
                    generated[n] + 1
                )  # keep rate so far (optimistic at the start)
                jobs += [n] * math.ceil(need / max(rate, 0.25))
        if not jobs:
            break
        jobs = jobs[: min(cfg.batch_size, budget - sum(generated.values()))]
        seeds_text = [
            rng.choice(cfg.domains[n].seeds) if cfg.domains[n].seeds else "" for n in jobs
        ]
        prompts = [
            tok(prefixes[n] + s, add_special_tokens=False)["input_ids"]
            for n, s in zip(jobs, seeds_text, strict=True)
        ]
        seeds = [(cfg.seed * 1_000_003 + rounds * 100_003 + i) % 2**31 for i in range(len(jobs))]
        outs = backend.generate(prompts, seeds, stop_id)
        rounds += 1
        for n, seed_text, (ids, finish) in zip(jobs, seeds_text, outs, strict=True):
            generated[n] += 1
            tokens += len(ids)
            if len(kept[n]) >= quota[n]:  # the round asked for more than the domain still needed
                surplus[n] += 1
                continue
            text = (seed_text + tok.decode(ids, skip_special_tokens=True)).strip()
            reason = check_text(text, finish, cfg)
            if reason is None:
                norm = normalize(text)
                if norm in exact:
                    reason = "duplicate"
                elif near is not None and not near.add_if_new(norm):
                    reason = "near_duplicate"
            if reason is None:
                exact.add(norm)
                kept[n].append(
                    {
                        "id": f"synth-{n}-{len(kept[n])}",
                        "messages": [{"role": "user", "content": text}],
                        "category": n,
                    }
                )
            else:
                dropped[n][reason] += 1
        log.info("synthesize round %d: kept %s", rounds, {n: len(kept[n]) for n in names})
    gen_s = time.time() - gen_t0

    short = {n: quota[n] - len(kept[n]) for n in names if len(kept[n]) < quota[n]}
    if short:
        log.warning(
            "synthesize: %s short of their quotas after %d generations (max_attempts_factor=%s); "
            "see the drop reasons in %s",
            short,
            sum(generated.values()),
            cfg.max_attempts_factor,
            out / MANIFEST,
        )
    if not any(kept.values()):
        raise ValueError(
            f"synthesize kept no prompt out of {sum(generated.values())} generated (dropped: "
            f"{dict(sum(dropped.values(), Counter()))}); loosen the filters or raise max_new_tokens"
        )
    rows = [r for n in names for r in kept[n]]
    random.Random(cfg.seed).shuffle(
        rows
    )  # domains interleaved, so a --limit downstream takes every domain
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / OUTPUT) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    total_dropped = sum(dropped.values(), Counter())
    manifest = {
        "stage": "synthesize",
        "fingerprint": fp,
        "target": str(cfg.target),
        "output": OUTPUT,
        "output_sha256": sha256_file(out / OUTPUT),
        "counts": {
            "kept": len(rows),
            "generated": sum(generated.values()),
            "generated_tokens": tokens,
            "dropped": {r: total_dropped[r] for r in DROP_REASONS},
            "shortfall": short,
            "surplus": sum(surplus.values()),
        },
        "per_domain": {
            n: {
                "quota": quota[n],
                "kept": len(kept[n]),
                "generated": generated[n],
                "surplus": surplus[n],
                "dropped": {r: dropped[n][r] for r in DROP_REASONS if dropped[n][r]},
            }
            for n in names
        },
        "template": {
            "user_turn_prefix": {n: prefixes[n] for n in names},
            "end_of_user_turn_id": stop_id,
            "end_of_user_turn": tok.convert_ids_to_tokens(stop_id),
        },
        "rounds": rounds,
        "engine": dict(backend.engine),
        "decode_tokens_per_s": round(tokens / max(gen_s, 1e-9), 1),
        "config": cfg.model_dump(mode="json"),
        "elapsed_s": round(time.time() - t0, 1),
    }
    write_json(out / MANIFEST, manifest)
    return _result(out, manifest, time.time() - t0)


def _result(out: Path, manifest: dict[str, Any], elapsed: float) -> SynthesizeResult:
    c = manifest["counts"]
    return SynthesizeResult(
        out=out,
        prompts_path=out / OUTPUT,
        num_prompts=c["kept"],
        per_domain={n: d["kept"] for n, d in manifest["per_domain"].items()},
        dropped={k: v for k, v in c["dropped"].items() if v},
        num_generated=c["generated"],
        elapsed_s=round(elapsed, 1),
        manifest=manifest,
    )
