"""The one train/validation split of captured samples: offline training (eagle3.train.trainer)
and streaming capture (eagle3.capture.spool, which captures the validation rows first) must agree
on it row for row."""

from __future__ import annotations

import torch


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, validation) indices of n samples, each sorted: a seeded permutation's first
    round(n * val_fraction) are validation (at least one when val_fraction > 0 and n >= 2)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    return sorted(perm[n_val:]), sorted(perm[:n_val])
