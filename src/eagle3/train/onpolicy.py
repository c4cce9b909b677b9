"""On-policy pieces of `eagle3 refine`: where a draft's rounds fail on rollouts, which rows to
train, the mix of rollout and supervised batches.

    replay = find_rejected_blocks(ttt, samples, head, k=3, steps=7, ...)  # the rounds vLLM runs
    weighted = StepWeighted(samples, replay.step_weights)  # the rows the refine loss trains
    loader = MixedLoader(rollout_loader, supervised_loader, share=0.5)

The replay is the offline estimator's (eagle3.train.estimate.iter_rounds over ttt_forward's
per-step hits): a round at row t drafts k tokens, accepts n of them, and the next round starts
n+1 rows on. A draft token counts as accepted when it is the rollout's next token
(`accept_on="next_token"`). Greedy, that is the target's argmax. At a temperature it is exactly
vLLM's rejection sampler: it takes EAGLE's greedy draft with one-hot draft probabilities (accept
with probability p(x)) and never emits a rejected draft token, so on a sequence sampled from the
target the emitted token equals the draft's iff the draft's was accepted.

Training rows ("rounds"): at each replayed round start t, TTT steps 0..min(n, k-1) (the accepted
ones and the first rejected one, weighted `rejected_weight`). Rows inside an accepted block are no
round start and weigh 0; the round after a rejection starts at the rejected token, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.train.data import WithColumn, eval_rows, pack_batch, sample_num_tokens
from eagle3.train.estimate import RoundCounts, iter_rounds
from eagle3.train.loss import TargetHead
from eagle3.train.step import STAT_COLUMNS


class StepWeighted(WithColumn):
    """Samples with `step_weight` added: (T, K) float, the loss weight of TTT step j at row t."""

    def __init__(self, samples: Sequence[dict[str, Any]], weights: list[torch.Tensor]):
        super().__init__(samples, "step_weight", weights)


@dataclass
class Replay:
    """The drafting rounds a draft runs over rollouts, per sample."""

    step_weights: list[torch.Tensor]  # per sample (T, K): the refine loss's rows (module docstring)
    error_masks: list[torch.Tensor]  # per sample (T, K): 1 at each round's first rejected step only
    rounds: dict[int, list[tuple[int, int]]]  # sample index -> [(round-start row, tokens accepted)]
    counts: RoundCounts = field(default_factory=RoundCounts)

    @property
    def num_rejected_blocks(self) -> int:
        """Rounds in which a draft token was rejected (fewer than k accepted)."""
        k = len(self.counts.accepted_per_position)
        return sum(1 for rs in self.rounds.values() for _, n in rs if n < k)

    def trained_samples(self) -> list[int]:
        """The samples with at least one trained row."""
        return [i for i, w in enumerate(self.step_weights) if bool(w.any())]


@torch.no_grad()
def find_rejected_blocks(
    ttt: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    head: TargetHead,
    *,
    k: int,
    steps: int,
    max_seq_len: int,
    batch_size: int,
    device: Any,
    dtype: torch.dtype,
    attention: str = "auto",
    rejected_weight: float = 1.0,
) -> Replay:
    """Replay the draft's rounds (k tokens each) over every sample: packed as eval_batches packs
    them, one TTT forward of k steps per batch on `device`, then iter_rounds per batch, each round
    mapped back to its sample and row. Weights have `steps` (the training unroll's K >= k)
    columns; steps >= k weigh 0."""
    if steps < k:
        raise ValueError(f"the training unroll has {steps} steps, fewer than k = {k}")
    was_training = ttt.training
    ttt.eval()
    # numpy while filling (a scalar store per round; torch indexing costs ~10x more per call)
    weights = [
        np.zeros((sample_num_tokens(samples, i), steps), np.float32) for i in range(len(samples))
    ]
    errors = [np.zeros_like(w) for w in weights]
    rounds: dict[int, list[tuple[int, int]]] = {}
    counts = RoundCounts(0, [0] * k)
    rows = eval_rows(samples, range(len(samples)), max_seq_len, batch_size)
    on_gpu = torch.device(device).type == "cuda"
    with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
        for a in range(0, len(rows), batch_size):
            group = rows[a : a + batch_size]
            b = pack_batch([[samples[i] for i in docs] for docs in group], max_seq_len)
            b = b.to(device, dtype if on_gpu else torch.float32)
            out = ttt(
                b, head, steps=k, return_correct=True, attention=attention, accept_on="next_token"
            )
            doc, pos = b.doc_ids.cpu(), b.positions.cpu()  # (B, T)
            for r, t, n in iter_rounds(out[2], out[3], b.doc_ids, k):
                i, row = group[r][int(doc[r, t])], int(pos[r, t])
                rounds.setdefault(i, []).append((row, n))
                counts.num_rounds += 1
                for j in range(n):
                    counts.accepted_per_position[j] += 1
                weights[i][row, : min(n + 1, k)] = 1.0
                if n < k:
                    weights[i][row, n] = rejected_weight
                    errors[i][row, n] = 1.0
    ttt.train(was_training)
    return Replay(
        [torch.from_numpy(w) for w in weights],
        [torch.from_numpy(e) for e in errors],
        rounds,
        counts,
    )


def all_rows_weights(samples: Sequence[dict[str, Any]], steps: int) -> list[torch.Tensor]:
    """Every row and step weighs 1 (loss_rows = all: plain TTT on the rollouts; the step's own
    masks still keep only supervised rows)."""
    return [torch.ones(sample_num_tokens(samples, i), steps) for i in range(len(samples))]


@torch.no_grad()
def weighted_ce(
    ttt: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    head: TargetHead,
    *,
    steps: int,
    max_seq_len: int,
    batch_size: int,
    device: Any,
    dtype: torch.dtype,
    **options: Any,
) -> float:
    """Mean soft cross-entropy over the weighted (row, step) pairs of `samples` (each carrying
    `step_weight`), every step pooled: e.g. the loss at the rounds' rejected positions
    (Replay.error_masks). NaN when there are none."""
    was_training = ttt.training
    ttt.eval()
    stats = torch.zeros(steps, len(STAT_COLUMNS), device=device)  # (K, columns)
    rows = eval_rows(samples, range(len(samples)), max_seq_len, batch_size)
    on_gpu = torch.device(device).type == "cuda"
    with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
        for a in range(0, len(rows), batch_size):
            docs = [[samples[i] for i in row] for row in rows[a : a + batch_size]]
            b = pack_batch(docs, max_seq_len).to(device, dtype if on_gpu else torch.float32)
            stats += ttt(b, head, steps=steps, **options)[1]
    ttt.train(was_training)
    ce = stats[:, STAT_COLUMNS.index("ce_sum")].sum()
    n = stats[:, STAT_COLUMNS.index("n_loss")].sum()
    return float(ce / n) if float(n) > 0 else math.nan


class MixedLoader:
    """Micro-batches from two PackedLoaders: micro-batch i is the supervised one's when
    floor((i + 1) * share) > floor(i * share) (so `share` of them, evenly spread), else the
    rollouts' one. Each micro-batch's loss is the mean over its own rows, so `share` is the
    supervised objective's share of the gradient. The trainer's loader protocol
    (eagle3.train.data.PackedLoader)."""

    def __init__(self, rollouts: Any, supervised: Any | None, share: float):
        if supervised is None and share > 0:
            raise ValueError(f"supervised_share = {share} needs supervised batches; none given")
        self.rollouts, self.supervised, self.share = rollouts, supervised, share
        self.count = 0
        self.last_rows: list[Any] = []
        self.last_source = "rollouts"

    def __iter__(self) -> MixedLoader:
        return self

    def source_of(self, i: int) -> str:
        more = math.floor((i + 1) * self.share) > math.floor(i * self.share)
        return "supervised" if more else "rollouts"

    def __next__(self):
        self.last_source = self.source_of(self.count)
        loader = self.supervised if self.last_source == "supervised" else self.rollouts
        batch = next(loader)
        self.count += 1
        self.last_rows = [(self.last_source, rows) for rows in loader.last_rows]
        return batch

    @property
    def wait_s(self) -> float:
        loaders = (self.rollouts, self.supervised)
        return sum(getattr(x, "wait_s", 0.0) for x in loaders if x is not None)

    def name_nonfinite(self, rows: list[Any]) -> str | None:
        found = [
            (self.supervised if src == "supervised" else self.rollouts).name_nonfinite([docs])
            for src, docs in rows
        ]
        return ", ".join(f for f in found if f) or None

    def epoch_progress(self) -> float:
        return self.rollouts.epoch_progress()

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "rollouts": self.rollouts.state_dict(),
            "supervised": self.supervised.state_dict() if self.supervised is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.rollouts.load_state_dict(state["rollouts"])
        if self.supervised is not None and state.get("supervised") is not None:
            self.supervised.load_state_dict(state["supervised"])

    def wants_checkpoint(self) -> bool:
        return False

    def on_checkpoint(self, ckpt: Path) -> None:
        """Nothing to do: both sources are read-only."""

    def close(self, finished: bool) -> None:
        for x in (self.rollouts, self.supervised):
            if x is not None:
                x.close(finished)
