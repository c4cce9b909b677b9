"""Stage 4, vocab: the draft vocabulary from supervised-token frequencies.

The draft's lm_head predicts only `draft_vocab_size` target tokens. We keep the N most frequent
loss-masked (assistant) tokens, ties broken by the lower id, sorted by target id, and write the two
maps vLLM's EAGLE-3 head uses:
  d2t: int64 [N], offsets such that target_id = draft_id + d2t[draft_id]
  t2d: bool  [V], True where a target id is in the draft vocabulary
When fewer than N distinct tokens were seen, the lowest unused ids fill the rest (so N is exact).

coverage.json and coverage.md hold the coverage table: the fraction of supervised tokens the top-n
tokens cover, for n = N/8 .. 4N and the usual draft sizes (1k .. 64k) up to the target vocabulary —
what choosing another draft vocab size would keep (a large target vocabulary, e.g. SmolLM2's 49,152
or Llama-3's 128k, is mostly unused by any one dataset).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3.artifacts import DraftVocab, PreparedMeta
from eagle3.config import ConfigError, VocabConfig
from eagle3.io import sha256_file, write_json, write_text
from eagle3.prepared import load_prepared

#: draft vocab sizes always in the coverage table (those up to the target vocabulary)
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


@dataclass
class VocabResult:
    out: Path
    draft_vocab_size: int
    target_vocab_size: int
    num_distinct_seen: int
    num_padded: int
    coverage: float
    coverage_at: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0


def count_supervised_tokens(
    input_ids: list[np.ndarray], loss_masks: list[np.ndarray], vocab_size: int
) -> np.ndarray:
    """Frequency of each token id over loss-masked positions. Returns (V,) int64."""
    if not input_ids:
        return np.zeros(vocab_size, dtype=np.int64)
    ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids])  # (total,)
    mask = np.concatenate([np.asarray(m).astype(bool) for m in loss_masks])  # (total,)
    sup = ids[mask]  # (num_supervised,)
    if sup.size and (sup.min() < 0 or sup.max() >= vocab_size):
        raise ValueError(
            f"token id {int(sup.max())} outside the target vocabulary of size {vocab_size}"
        )
    return np.bincount(sup, minlength=vocab_size).astype(np.int64)


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top-N ids by count (ties: lower id first), padded with the lowest unused ids; vectorized."""
    V = counts.shape[0]
    if draft_vocab_size > V:
        raise ConfigError(
            f"draft_vocab_size = {draft_vocab_size} exceeds the target vocabulary ({V}); use at "
            f"most {V}"
        )
    ids = np.arange(V, dtype=np.int64)
    order = np.lexsort((ids, -counts))  # (V,) most frequent first, then by id
    num_seen = int((counts > 0).sum())
    chosen = order[: min(num_seen, draft_vocab_size)]  # (n_seen,)
    num_pad = draft_vocab_size - chosen.shape[0]
    if num_pad:
        unused = np.ones(V, dtype=bool)
        unused[chosen] = False
        chosen = np.concatenate([chosen, ids[unused][:num_pad]])  # (N,)
    draft_ids = np.sort(chosen)  # (N,)
    d2t = draft_ids - np.arange(draft_vocab_size, dtype=np.int64)  # (N,)
    t2d = np.zeros(V, dtype=bool)  # (V,)
    t2d[draft_ids] = True
    return DraftVocab(d2t=d2t, t2d=t2d, draft_ids=draft_ids)


def coverage_at_sizes(counts: np.ndarray, sizes: list[int]) -> dict[int, float]:
    """Fraction of supervised tokens covered by the top-n tokens, for each n in sizes."""
    total = counts.sum()
    sorted_counts = np.sort(counts)[::-1]  # (V,)
    cum = np.cumsum(sorted_counts)  # (V,)
    out = {}
    for n in sizes:
        n = min(n, counts.shape[0])
        out[int(n)] = float(cum[n - 1] / total) if total and n > 0 else 0.0
    return out


def format_coverage(
    cov: dict[int, float],
    draft_vocab_size: int,
    target_vocab_size: int,
    num_supervised: int,
    num_seen: int,
) -> str:
    """The coverage table as markdown."""
    lines = [
        f"# Draft vocabulary coverage\n\n{num_supervised} supervised tokens, {num_seen} distinct "
        f"of the target's {target_vocab_size}; chosen draft vocab size {draft_vocab_size}.\n",
        "| draft vocab size | % of target vocab | coverage of supervised tokens |",
        "|---:|---:|---:|",
    ]
    for n, c in sorted(cov.items()):
        mark = " (chosen)" if n == draft_vocab_size else ""
        lines.append(f"| {n}{mark} | {100 * n / target_vocab_size:.1f} % | {100 * c:.2f} % |")
    return "\n".join(lines) + "\n"


def run_vocab(cfg: VocabConfig) -> VocabResult:
    cfg.require("data", "out")
    t0 = time.time()
    manifest = PreparedMeta.load(cfg.data)
    ds = load_prepared(cfg.data)
    V = manifest.vocab_size
    counts = count_supervised_tokens(list(ds["input_ids"]), list(ds["loss_mask"]), V)
    vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
    N = cfg.draft_vocab_size
    sizes = sorted(
        {s for s in (N // 8, N // 4, N // 2, N, 2 * N, 4 * N, *COVERAGE_SIZES, V) if 0 < s <= V}
    )
    cov = coverage_at_sizes(counts, sizes)
    num_seen = int((counts > 0).sum())
    out = Path(cfg.out)
    vocab_path = vocab.save(out)
    report = {
        "stage": "vocab",
        "data": str(cfg.data),
        "draft_vocab_size": N,
        "target_vocab_size": V,
        "num_supervised_tokens": int(counts.sum()),
        "num_distinct_seen": num_seen,
        "num_padded": max(0, N - num_seen),
        "coverage": cov[N],
        "coverage_at": {str(k): v for k, v in cov.items()},
        "vocab_sha256": sha256_file(vocab_path),
        "prepared_manifest": {
            "source": manifest.source,
            "source_sha256": manifest.source_sha256,
            "tokenizer_sha256": manifest.tokenizer_sha256,
            "num_samples": manifest.num_samples,
        },
    }
    write_json(out / "coverage.json", report)
    write_text(out / "coverage.md", format_coverage(cov, N, V, int(counts.sum()), num_seen))
    return VocabResult(
        out=out,
        draft_vocab_size=N,
        target_vocab_size=V,
        num_distinct_seen=num_seen,
        num_padded=report["num_padded"],
        coverage=cov[N],
        coverage_at=cov,
        wall_s=round(time.time() - t0, 3),
    )
