"""An exponential moving average of the draft's trainable weights (`train.ema_decay`).

It only touches each rank's own parameter tensors, so it works alike on one device, under DDP
(replicas stay equal) and under FSDP2 (each rank averages its shard). The trainer swaps the average
in to validate and to save best/, final/ and checkpoints, and swaps the raw weights back to keep
training.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class WeightAverage:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer step `step` (0-based); the decay ramps up as
        (1+step)/(10+step) so the first steps do not keep the random init in the average."""
        weight = 1.0 - min(self.decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params, strict=True):
            s.lerp_(p.detach(), weight)

    @torch.no_grad()
    def swap(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            raw = p.detach().clone()
            p.copy_(s)
            s.copy_(raw)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The average in the parameters inside the block, the raw weights after it."""
        self.swap()
        try:
            yield
        finally:
            self.swap()

    @torch.no_grad()
    def reset(self) -> None:
        """Take the current parameters as the average (after loading it into them on resume)."""
        for s, p in zip(self.shadow, self.params, strict=True):
            s.copy_(p.detach())
