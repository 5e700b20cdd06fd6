"""Overlong handling (DAPO, Yu et al. 2025, arXiv 2503.14476, section 3.4), as pure functions.

`assembler.overlong`:
- "none": rewards and samples as scored (today's behaviour exactly).
- "soft_penalty": DAPO's soft overlong punishment added to the reward before advantages,
      R_len(L) = 0                          if L <= L_max - L_cache
               = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
               = -1                         if L > L_max,
  with L the sample's tokens, L_max the generator's max_tokens and L_cache assembler.overlong_buffer.
- "filter": DAPO's overlong filtering: a truncated sample (finish_reason "length") keeps its place in its
  group's advantages but is cut from the batch, so it adds nothing to the loss or its normalisers.

Invariants:
- "none" returns the rewards unchanged and keeps every sample.
- The penalty is in [-1, 0], 0 below the buffer and monotone non-increasing in L.
- A sample's length L counts what the generator's max_tokens budget counts: every id after the prompt,
  a multi-turn episode's observation tokens included (actors/generator/episode.py).
"""
from __future__ import annotations

from typing import Sequence

OVERLONG_MODES = ("none", "filter", "soft_penalty")


def soft_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's R_len(length) (see the module docstring)."""
    if length > max_tokens:
        return -1.0
    start = max_tokens - buffer
    return 0.0 if length <= start else (start - length) / buffer


def shape(rewards: Sequence[float], lengths: Sequence[int], truncated: Sequence[bool], mode: str,
          max_tokens: int, buffer: int) -> tuple[list[float], list[bool], dict[str, float]]:
    """(shaped rewards, keep per sample, counts) of one group under `mode`.

    counts: overlong_truncated (samples cut by max_tokens), overlong_filtered (samples dropped by
    "filter"), overlong_penalised (samples with a penalty < 0), overlong_penalty_sum."""
    if mode not in OVERLONG_MODES:
        raise ValueError(f"unknown overlong mode {mode!r} ({' | '.join(OVERLONG_MODES)})")
    n = len(rewards)
    counts = {"overlong_truncated": float(sum(map(bool, truncated))), "overlong_filtered": 0.0,
              "overlong_penalised": 0.0, "overlong_penalty_sum": 0.0}
    if mode == "filter":
        keep = [not t for t in truncated]
        counts["overlong_filtered"] = float(n - sum(keep))
        return list(rewards), keep, counts
    if mode == "soft_penalty":
        pens = [soft_penalty(int(length), max_tokens, buffer) for length in lengths]
        counts["overlong_penalised"] = float(sum(p < 0 for p in pens))
        counts["overlong_penalty_sum"] = float(sum(pens))
        return [float(r) + p for r, p in zip(rewards, pens)], [True] * n, counts
    return list(rewards), [True] * n, counts
