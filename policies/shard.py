"""Which learner rank runs which micro-batch of a minibatch (data parallel).

Invariants:
- Every micro-batch is run by exactly one rank.
- Every rank makes the same number of forward/backward calls, ceil(n / world_size) (at least 1):
  collectives inside a call (ZeRO-3's parameter gathers, the gradient all-reduce at the
  accumulation boundary) then pair up across ranks and never hang. A rank with fewer real
  micro-batches gets `None` slots: the learner runs an empty, zero-weight micro-batch there.
- Balanced by tokens: the largest micro-batch first, each to the least-loaded rank that still has
  a free slot (ties to the lowest rank).
- Deterministic: every rank computes the same split from the same token counts, with no
  communication. A rank runs its micro-batches in their original order, `None` slots last.
"""
from __future__ import annotations

from typing import Sequence


def split_across_ranks(tokens: Sequence[int], world_size: int) -> list[list[int | None]]:
    """Token counts of a minibatch's micro-batches -> per rank, the indices it runs (None: empty slot)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(t < 0 for t in tokens):
        raise ValueError(f"micro-batch token counts must be >= 0, got {list(tokens)}")
    n = len(tokens)
    slots = max(1, -(-n // world_size))
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world_size) if len(owned[r]) < slots), key=lambda r: (loads[r], r))
        owned[rank].append(i)
        loads[rank] += tokens[i]
    return [sorted(mine) + [None] * (slots - len(mine)) for mine in owned]
