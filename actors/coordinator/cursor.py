"""Where the coordinator is in the training prompts: epoch, position and shuffle seed.

Invariants:
- The order of an epoch is a pure function of (seed, epoch): a cursor rebuilt from `state()` after a
  crash takes the same prompts next as the one that was saved.
- Every prompt is taken once per epoch; an epoch ends only when all were taken.
"""
from __future__ import annotations

import random


class DataCursor:
    """Epoch, position and shuffle seed over the training prompts; deterministic and resumable."""

    def __init__(self, num_items: int, seed: int, epoch: int = 0, position: int = 0):
        self.num_items, self.seed, self.epoch, self.position = num_items, seed, epoch, position
        self._order = self._shuffle(epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position >= self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}
