"""GRPO group advantages, on numpy (no torch: the assembler computes them, and it holds no tensor).

Invariants:
- The advantage of sample i of a group is its reward minus the group's mean, over the group's
  unbiased std plus eps when normalize_std (as in the GRPO paper and verl), computed in float64.
- A group whose rewards are all equal (or that has one sample) carries no signal: its advantages are
  exactly 0 and its zero-variance flag is True, so the assembler can filter it.
- policies.grpo.group_advantages is this function for torch tensors.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def group_advantages(rewards: Any, normalize_std: bool = True, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """`rewards` [groups, n] (array-like) -> (advantages [groups, n] float64, zero_variance [groups] bool)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(r.shape)}")
    zero_variance = (r == r[:, :1]).all(axis=1)
    centred = r - r.mean(axis=1, keepdims=True)
    if normalize_std and r.shape[1] > 1:
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    return np.where(zero_variance[:, None], 0.0, centred), zero_variance
