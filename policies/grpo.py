"""GRPO advantages and the policy loss (policies.objectives' surrogate, aggregated), as pure functions.

Invariants:
- `policy_loss` summed over the micro-batches of a minibatch, each called with the minibatch's
  `normalizer` (its total valid tokens for "token-mean", its total sequences for
  "seq-mean-token-mean" and "seq-mean-token-sum-norm"), equals the loss of the whole minibatch in one
  call. Gradient
  accumulation therefore changes nothing but memory.
- Tokens where `mask` is False (prompt, padding, a multi-turn episode's observation tokens) contribute
  nothing to the loss, its token-count normaliser, the importance weights or the metrics: a masked
  token is exactly a token cut from the batch.
- When `logprobs == old_logprobs` the ratio is exactly 1: ppo_kl and clipfrac are exactly 0.
- Importance weights against the behaviour policy (`gen_logprobs`: the sampler's log-probs) are
  detached: they rescale the gradient of a stale or mismatched token and never receive gradient.
  `old_logprobs` is the proximal policy (recomputed by the learner); the weights and their modes
  are policies.offpolicy's. `correction=None` keeps the legacy switch: TIS at `tis_cap` when
  `tis_cap > 0`, else no weight (mismatch_kl is still reported).
- "seq-mean-token-sum-norm" (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783) divides each sequence's
  token sum by one constant, `norm_tokens` (learner.loss_norm_tokens: the generator's max_tokens unless
  set), so a sample's weight does not depend on its length: loss = sum_i sum_t l_it / (G * norm_tokens).
- Every metric is a python float.
"""
from __future__ import annotations

from typing import Literal

import torch

from policies import advantages
from policies.objectives import surrogate
from policies.offpolicy import importance_weights, segment_sums

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages of `rewards` [groups, n]: reward minus its group mean, over the group std
    (policies.advantages, on numpy in float64; the assembler calls that one).

    Returns (advantages [groups, n], zero_variance_mask [groups]). A group whose rewards are all
    equal (or that has one sample) carries no signal: its advantages are exactly 0 and its mask
    entry is True, so the assembler can filter it.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    adv, zero_variance = advantages.group_advantages(rewards.detach().to("cpu", torch.float64).numpy(),
                                                     normalize_std, eps)
    out = torch.from_numpy(adv).to(rewards.device)
    return (out.to(rewards.dtype if rewards.is_floating_point() else torch.float32),
            torch.from_numpy(zero_variance).to(rewards.device))


def _aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, normalizer: float | None,
               seq_ids: torch.Tensor | None, norm_tokens: float = 0.0) -> torch.Tensor:
    """Sum of masked `values`, over the normaliser of `agg` (see the module invariant)."""
    # where, not multiply: a nan/inf at a masked position (padding) must not leak into the sum.
    values = torch.where(mask, values, torch.zeros_like(values))
    if agg == "token-mean":
        denom = mask.sum().clamp(min=1).to(values.dtype) if normalizer is None else normalizer
        return values.sum() / denom
    if agg == "seq-mean-token-mean":
        per_seq_sum, per_seq_len, _, _ = segment_sums(values, mask, seq_ids)
        if len(per_seq_sum) == 0:
            return values.sum() * 0.0
        denom = float(len(per_seq_sum)) if normalizer is None else normalizer
        return (per_seq_sum / per_seq_len).sum() / denom
    if agg == "seq-mean-token-sum-norm":
        if norm_tokens <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_tokens > 0 (learner.loss_norm_tokens)")
        per_seq_sum, _, _, _ = segment_sums(values, mask, seq_ids)
        if len(per_seq_sum) == 0:
            return values.sum() * 0.0
        denom = float(len(per_seq_sum)) if normalizer is None else normalizer
        return per_seq_sum.sum() / (denom * norm_tokens)
    raise ValueError(f"unknown loss aggregation {agg!r} ({' | '.join(LOSS_AGGS)})")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, values.detach(), torch.zeros_like(values)).sum() / n) if n else 0.0


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                agg: LossAgg = "token-mean", ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0, entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                gen_logprobs: torch.Tensor | None = None, tis_cap: float = 0.0,
                seq_ids: torch.Tensor | None = None, normalizer: float | None = None,
                correction: str | None = None, is_cap: float = 2.0, objective: str = "ppo_clip",
                norm_tokens: float = 0.0,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of `objective` (policies.objectives: ppo_clip, gspo, cispo), per-token advantages.

    All tensors share one shape (flat packed tokens [T] or [B, L]); `advantages` is the
    sample's advantage broadcast over its tokens. `mask` selects the completion tokens.
    loss = agg(l * w) + kl_coef agg(k3), l = objective's per-token loss, for ppo_clip
    l = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), with
           - entropy_coef agg(entropy), with r = exp(logprobs - old_logprobs) and
    w = policies.offpolicy.importance_weights(old_logprobs, gen_logprobs, mode, cap) (detached), with
    mode, cap = correction, is_cap; or, when correction is None, ("tis", tis_cap) if tis_cap > 0 else no
    weight (the legacy switch). Without gen_logprobs, w = 1.
    `normalizer`: see the module invariant; None uses this call's own count.
    `seq_ids`: the sample of each token, needed for the seq-mean aggregations and gspo on flat tokens.
    `norm_tokens`: the constant of "seq-mean-token-sum-norm".
    Metrics are means over this call's valid tokens (weight them by `num_tokens` to combine).
    """
    mask = mask.bool()
    # Zero every input at masked positions first: a nan there would otherwise reach the
    # gradient through 0 * nan, even though torch.where drops it from the forward value.
    def clean(t):
        return None if t is None else torch.where(mask, t, torch.zeros_like(t))
    logprobs, old_logprobs, advantages = clean(logprobs), clean(old_logprobs), clean(advantages)
    ref_logprobs, entropy, gen_logprobs = clean(ref_logprobs), clean(entropy), clean(gen_logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.detach())
    pg_per_token, clip_ratio, clipped = surrogate(objective, log_ratio, advantages, mask, clip_low, clip_high,
                                                  seq_ids)

    metrics: dict[str, float] = {}
    if gen_logprobs is not None:
        legacy = correction is None
        mode = ("tis" if tis_cap > 0 else "off") if legacy else correction
        weight, is_metrics = importance_weights(old_logprobs, gen_logprobs, mask, mode, tis_cap if legacy else is_cap,
                                                seq_ids=seq_ids)
        metrics["mismatch_kl"] = is_metrics["mismatch_kl"]
        if mode != "off":
            pg_per_token = pg_per_token * weight
            metrics.update({k: v for k, v in is_metrics.items() if k.startswith("is_")})
        if legacy and mode == "tis":  # the names the tis_cap switch always reported
            metrics["tis_weight_mean"] = is_metrics["is_weight_mean"]
            metrics["tis_capped_frac"] = _masked_mean((weight >= tis_cap).to(ratio.dtype), mask)

    pg_loss = _aggregate(pg_per_token, mask, agg, normalizer, seq_ids, norm_tokens)
    loss = pg_loss

    if ref_logprobs is not None:
        # k3 estimator of KL(pi || ref): unbiased, always >= 0 (Schulman's "approximating KL").
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1.0
        kl_loss = _aggregate(kl, mask, agg, normalizer, seq_ids, norm_tokens)
        if kl_coef:
            loss = loss + kl_coef * kl_loss
        metrics["kl"] = _masked_mean(kl, mask)
    if entropy is not None:
        ent = _aggregate(entropy, mask, agg, normalizer, seq_ids, norm_tokens)
        if entropy_coef:
            loss = loss - entropy_coef * ent
        metrics["entropy"] = _masked_mean(entropy, mask)

    with torch.no_grad():
        n = int(mask.sum())
        is_clipped = clipped.to(ratio.dtype)
        metrics.update(
            pg_loss=float(pg_loss.detach()),
            ppo_kl=_masked_mean(-log_ratio, mask),
            clipfrac=_masked_mean(is_clipped, mask),
            clipfrac_low=_masked_mean(is_clipped * (clip_ratio < 1.0 - clip_low).to(ratio.dtype), mask),
            clipfrac_high=_masked_mean(is_clipped * (clip_ratio > 1.0 + clip_high).to(ratio.dtype), mask),
            ratio_mean=_masked_mean(ratio, mask),
            ratio_max=float(ratio.detach()[mask].max()) if n else 1.0,
            ratio_min=float(ratio.detach()[mask].min()) if n else 1.0,
            num_tokens=float(n),
        )
    return loss, metrics
