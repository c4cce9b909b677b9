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
from eagle3.io import read_json, sha256_file, sha256_json, write_json, write_jsonl
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
            per_request_seeds=cfg.temperature > 0,
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

    tok = _open_tokenizer(cfg)
    stop_id = end_of_user_turn(tok)
    prefixes = {n: user_turn_prefix(tok, d.system) for n, d in cfg.domains.items()}
    backend: Any = _HfBackend(cfg) if cfg.backend == "hf" else _VllmBackend(cfg, llm)
    pool = _PromptPool.start(cfg)
    gen_t0 = time.time()
    _generate_prompts(cfg, tok, backend, pool, prefixes, stop_id)
    gen_s = time.time() - gen_t0
    pool.check_kept(out / MANIFEST)
    rows = [r for n in pool.names for r in pool.kept[n]]
    random.Random(cfg.seed).shuffle(
        rows
    )  # domains interleaved, so a --limit downstream takes every domain
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / OUTPUT, rows)
    manifest = {
        "stage": "synthesize",
        "fingerprint": fp,
        "target": str(cfg.target),
        "output": OUTPUT,
        "output_sha256": sha256_file(out / OUTPUT),
        **pool.record(),
        "template": {
            "user_turn_prefix": prefixes,
            "end_of_user_turn_id": stop_id,
            "end_of_user_turn": tok.convert_ids_to_tokens(stop_id),
        },
        "rounds": pool.rounds,
        "engine": dict(backend.engine),
        "decode_tokens_per_s": round(pool.tokens / max(gen_s, 1e-9), 1),
        "config": cfg.model_dump(mode="json"),
        "elapsed_s": round(time.time() - t0, 1),
    }
    write_json(out / MANIFEST, manifest)
    return _result(out, manifest, time.time() - t0)


def _open_tokenizer(cfg: SynthesizeConfig) -> Any:
    """The target's tokenizer, which must have a chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cfg.target), trust_remote_code=cfg.trust_remote_code)
    if not tok.chat_template:
        raise ValueError(
            f"target={cfg.target}: the tokenizer has no chat template; synthesize renders the "
            "start of a user turn with it"
        )
    return tok


@dataclass
class _PromptPool:
    """The prompts kept so far per domain, and the counts of what was generated and dropped."""

    cfg: SynthesizeConfig
    names: list[str]
    quota: dict[str, int]
    kept: dict[str, list[dict[str, Any]]]
    dropped: dict[str, Counter]
    near: NearDuplicateIndex | None
    exact: set[str] = field(default_factory=set)  # the kept prompts, normalized
    generated: Counter = field(default_factory=Counter)
    #: valid or not, generated after the domain's quota was met
    surplus: Counter = field(default_factory=Counter)
    tokens: int = 0
    rounds: int = 0

    @classmethod
    def start(cls, cfg: SynthesizeConfig) -> _PromptPool:
        names = list(cfg.domains)
        near = (
            NearDuplicateIndex(cfg.near_duplicate_jaccard, seed=cfg.seed)
            if cfg.near_duplicate_jaccard < 1
            else None
        )
        return cls(
            cfg,
            names,
            domain_quotas(cfg),
            kept={n: [] for n in names},
            dropped={n: Counter() for n in names},
            near=near,
        )

    @property
    def num_generated(self) -> int:
        return sum(self.generated.values())

    def next_domains(self, budget: int) -> list[str]:
        """The domain of each prompt to generate in the next round: a domain short of its quota
        asks for its shortfall over its keep rate so far; [] when every quota is met."""
        jobs: list[str] = []
        for n in self.names:
            need = self.quota[n] - len(self.kept[n])
            if need > 0:
                rate = (len(self.kept[n]) + 1) / (
                    self.generated[n] + 1
                )  # keep rate so far (optimistic at the start)
                jobs += [n] * math.ceil(need / max(rate, 0.25))
        return jobs[: min(self.cfg.batch_size, budget - self.num_generated)]

    def count(self, n: str, ids: list[int]) -> bool:
        """Count one generation for domain `n`; whether the domain still needs prompts."""
        self.generated[n] += 1
        self.tokens += len(ids)
        if len(self.kept[n]) >= self.quota[n]:  # the round asked for more than it still needed
            self.surplus[n] += 1
            return False
        return True

    def judge(self, n: str, text: str, finish: str | None) -> None:
        """Keep `text` as a prompt of domain `n`, or count why it is dropped."""
        reason = check_text(text, finish, self.cfg)
        if reason is None:
            norm = normalize(text)
            if norm in self.exact:
                reason = "duplicate"
            elif self.near is not None and not self.near.add_if_new(norm):
                reason = "near_duplicate"
        if reason is None:
            self.exact.add(norm)
            self.kept[n].append(
                {
                    "id": f"synth-{n}-{len(self.kept[n])}",
                    "messages": [{"role": "user", "content": text}],
                    "category": n,
                }
            )
        else:
            self.dropped[n][reason] += 1

    def shortfall(self) -> dict[str, int]:
        return {
            n: self.quota[n] - len(self.kept[n])
            for n in self.names
            if len(self.kept[n]) < self.quota[n]
        }

    def check_kept(self, manifest_path: Path) -> None:
        """Warn about domains short of their quota; ValueError when no prompt was kept."""
        short = self.shortfall()
        if short:
            log.warning(
                "synthesize: %s short of their quotas after %d generations "
                "(max_attempts_factor=%s); see the drop reasons in %s",
                short,
                self.num_generated,
                self.cfg.max_attempts_factor,
                manifest_path,
            )
        if not any(self.kept.values()):
            raise ValueError(
                f"synthesize kept no prompt out of {self.num_generated} generated (dropped: "
                f"{dict(sum(self.dropped.values(), Counter()))}); loosen the filters or raise "
                "max_new_tokens"
            )

    def record(self) -> dict[str, Any]:
        """The manifest's counts and per-domain figures."""
        total_dropped = sum(self.dropped.values(), Counter())
        return {
            "counts": {
                "kept": sum(len(k) for k in self.kept.values()),
                "generated": self.num_generated,
                "generated_tokens": self.tokens,
                "dropped": {r: total_dropped[r] for r in DROP_REASONS},
                "shortfall": self.shortfall(),
                "surplus": sum(self.surplus.values()),
            },
            "per_domain": {
                n: {
                    "quota": self.quota[n],
                    "kept": len(self.kept[n]),
                    "generated": self.generated[n],
                    "surplus": self.surplus[n],
                    "dropped": {r: self.dropped[n][r] for r in DROP_REASONS if self.dropped[n][r]},
                }
                for n in self.names
            },
        }


def _generate_prompts(
    cfg: SynthesizeConfig,
    tok: Any,
    backend: Any,
    pool: _PromptPool,
    prefixes: dict[str, str],
    stop_id: int,
) -> None:
    """Generate rounds of user turns, each continuing a domain's user-turn prefix (and a seed
    text), until every quota is met or max_attempts_factor x num_prompts were generated."""
    rng = random.Random(cfg.seed)
    budget = math.ceil(cfg.max_attempts_factor * cfg.num_prompts)
    while pool.num_generated < budget:
        jobs = pool.next_domains(budget)
        if not jobs:
            break
        seeds_text = [
            rng.choice(cfg.domains[n].seeds) if cfg.domains[n].seeds else "" for n in jobs
        ]
        prompts = [
            tok(prefixes[n] + s, add_special_tokens=False)["input_ids"]
            for n, s in zip(jobs, seeds_text, strict=True)
        ]
        seeds = [
            (cfg.seed * 1_000_003 + pool.rounds * 100_003 + i) % 2**31 for i in range(len(jobs))
        ]
        outs = backend.generate(prompts, seeds, stop_id)
        pool.rounds += 1
        for n, seed_text, (ids, finish) in zip(jobs, seeds_text, outs, strict=True):
            if pool.count(n, ids):
                text = (seed_text + tok.decode(ids, skip_special_tokens=True)).strip()
                pool.judge(n, text, finish)
        log.info(
            "synthesize round %d: kept %s", pool.rounds, {n: len(pool.kept[n]) for n in pool.names}
        )


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
