"""Off-policy correction: importance weights from the proximal policy to the behaviour policy.

The decoupled PPO objective (AReaL's "decoupled PPO"; verl's rollout correction) separates two
policies that plain PPO conflates when generation is asynchronous or runs on other kernels:
- the PROXIMAL policy: the log-probs the learner recomputes once per step before its first
  update (`old_logprobs` in policies.grpo.policy_loss). The PPO ratio and its clip are taken
  against it, so the trust region is anchored on weights the learner actually holds;
- the BEHAVIOUR policy: the log-probs the engine reported when it sampled each token (possibly
  at an older version, possibly several versions within one sample after a partial rollout,
  and always with the engine's own numerics).
Each token's policy-gradient term is multiplied by an importance weight derived from
r = exp(proximal - behaviour), detached (it rescales, it never receives gradient):

- "tis"     truncated:  w = min(r, cap)
- "mis"     masked, per token: w = r if 1/cap <= r <= cap else 0 (the token drops out)
- "mis_seq" masked, per sequence: a sample whose geometric-mean ratio exp(mean_t log r) leaves
            [1/cap, cap] drops out whole (w = 0 on all its tokens); kept samples get min(r, cap)
- "off"     w = 1 (no correction; the metrics are still computed)

Invariants:
- When proximal == behaviour on every valid token (staleness 0, identical numerics) every weight
  is exactly 1.0 in every mode, and mismatch_kl, the truncated and the masked fractions are 0.
- A dropped token keeps its place in the loss normaliser (its term is 0, the denominator is not
  changed), so the sum over micro-batches still equals one call over the minibatch.
- Positions where `mask` is False never affect a weight or a metric (nan/inf there included).
- Every metric is a python float: `mismatch_kl` (k3 estimate of KL(behaviour || proximal) over
  the sampled tokens), `is_weight_mean`, `is_weight_max`, `is_truncated_frac`, `is_masked_frac`
  (token fractions), `num_tokens` (valid tokens, the weight for combining means).
"""
from __future__ import annotations

from typing import Literal

import torch

CorrectionMode = Literal["off", "tis", "mis", "mis_seq"]
MODES: tuple[str, ...] = ("off", "tis", "mis", "mis_seq")


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, values, torch.zeros_like(values)).sum() / n) if n else 0.0


def segment_sums(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: (sum of `values` over its valid tokens, its valid-token count), for the
    sequences with at least one valid token, plus each valid token's sequence index (`inverse`)
    and the flat validity mask. `seq_ids` gives each token's sample for flat packed tokens; None
    means the rows of a [B, L] tensor are the sequences."""
    if seq_ids is None:
        if values.ndim != 2:
            raise ValueError("per-sequence values on flat (packed) tokens need seq_ids")
        seq_ids = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(values)
    ids = torch.where(mask, seq_ids, torch.full_like(seq_ids, -1)).reshape(-1)
    valid = ids >= 0
    uniq, inverse = torch.unique(ids[valid], return_inverse=True)
    vals = values.reshape(-1)[valid]
    sums = torch.zeros(len(uniq), dtype=values.dtype, device=values.device).index_add(0, inverse, vals)
    counts = torch.zeros(len(uniq), dtype=values.dtype, device=values.device).index_add(0, inverse, torch.ones_like(vals))
    return sums, counts, inverse, valid


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    """Per-token tensor holding the mean of `values` over the valid tokens of its sequence (0 outside `mask`)."""
    sums, counts, inverse, valid = segment_sums(values, mask, seq_ids)
    out = torch.zeros(values.numel(), dtype=values.dtype, device=values.device)
    if len(sums):
        out[valid] = (sums / counts)[inverse]
    return out.reshape(values.shape)


@torch.no_grad()
def importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "tis", cap: float = 2.0, seq_ids: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token weight of `mode` (see the module docstring) and its metrics.

    Shapes as in policies.grpo.policy_loss (flat [T] with `seq_ids`, or [B, L]). `cap` > 1 for
    the masked modes (the kept band [1/cap, cap] must contain 1), > 0 for "tis"."""
    if mode not in MODES:
        raise ValueError(f"importance-weight mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "tis" and not cap > 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    if mode in ("mis", "mis_seq") and not cap > 1:
        raise ValueError(f"{mode} cap must be > 1 (tokens are kept for ratios in [1/cap, cap]), got {cap}")
    mask = mask.bool()
    zero = torch.zeros_like(proximal_logprobs)
    log_r = torch.where(mask, proximal_logprobs - behaviour_logprobs, zero).detach()
    r = torch.exp(log_r)
    ones = torch.ones_like(r)
    truncated = torch.zeros_like(mask)
    dropped = torch.zeros_like(mask)
    if mode == "off":
        w = ones
    elif mode == "tis":
        truncated = r > cap
        w = r.clamp(max=cap)
    elif mode == "mis":
        dropped = (r < 1.0 / cap) | (r > cap)
        w = torch.where(dropped, zero, r)
    else:  # mis_seq
        seq_r = torch.exp(sequence_mean(log_r, mask, seq_ids))
        dropped = (seq_r < 1.0 / cap) | (seq_r > cap)
        truncated = ~dropped & (r > cap)
        w = torch.where(dropped, zero, r.clamp(max=cap))
    w = torch.where(mask, w, ones)
    valid_w = w[mask]
    metrics = {
        "mismatch_kl": _mean(r - 1.0 - log_r, mask),
        "is_weight_mean": _mean(w, mask),
        "is_weight_max": float(valid_w.max()) if valid_w.numel() else 1.0,
        "is_truncated_frac": _mean((truncated & mask).to(r.dtype), mask),
        "is_masked_frac": _mean((dropped & mask).to(r.dtype), mask),
        "num_tokens": float(mask.sum()),
    }
    return w, metrics
