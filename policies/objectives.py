"""Policy-gradient objectives (the per-token surrogate before aggregation), as pure functions on tensors.

Each objective maps (log_ratio = logprobs - old_logprobs, advantages, mask) to a per-token loss whose
aggregation (policies.grpo's token-mean, seq-mean-token-mean or Dr.GRPO's seq-mean-token-sum-norm) is
the policy loss. `old_logprobs` is the proximal policy; the behaviour-policy weight (TIS/MIS) multiplies
the result in policies.grpo and composes with every objective.

Invariants:
- Tokens where `mask` is False (prompt, padding, an episode's observation tokens) never reach a value,
  a sequence ratio or a gradient: callers pass tensors already zeroed there, and a sequence ratio is the
  mean over the sequence's masked-in tokens only.
- When `log_ratio == 0` every objective's value is -A per token and its gradient is -A per token's
  log-prob (on-policy, all three are the same REINFORCE gradient); nothing is clipped.
- The returned `ratio` is the ratio the objective clips (per token, or the sequence ratio broadcast),
  `clipped` the tokens whose gradient the clip changed; both are detached.
"""
from __future__ import annotations

from typing import Literal

import torch

from policies.offpolicy import sequence_mean

Objective = Literal["ppo_clip", "gspo", "cispo"]
OBJECTIVES: tuple[str, ...] = ("ppo_clip", "gspo", "cispo")


def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip with clip-higher (Schulman et al. 2017, arXiv 1707.06347; DAPO, arXiv 2503.14476):
    l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = exp(log_ratio_t)."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_val = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped_val), ratio.detach(), (clipped_val > unclipped).detach()


def gspo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
         clip_high: float, seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the sequence-level ratio
    s_i = exp(mean_{t in y_i} log_ratio_t) (length-normalised), clipped as in PPO:
    l_t = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)) for every token t of sample i.
    Aggregated by seq-mean-token-mean this is the paper's objective exactly; its gradient reaches each
    token as -A_i s_i / |y_i| (unclipped). The paper's clip ranges are ~3e-4 / 4e-4, not PPO's 0.2."""
    seq_log_ratio = sequence_mean(log_ratio, mask, seq_ids)
    return ppo_clip(seq_log_ratio, advantages, clip_low, clip_high)


def cispo(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped, stop-gradient IS weight,
    l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(y_t), so every token keeps a gradient
    (-w_t A_t on its log-prob). The value is written -sg(w_t) A_t exp(lp_t - sg(lp_t)) = -w_t A_t, which
    has that gradient and reads like PPO's loss. clip_low=1 leaves the weight unbounded below (the paper)."""
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -advantages * weight * torch.exp(log_ratio - log_ratio.detach())
    return per_token, ratio, weight != ratio


def surrogate(objective: str, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, seq_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, the clipped ratio, clipped tokens) of `objective` (see each function)."""
    if objective == "ppo_clip":
        return ppo_clip(log_ratio, advantages, clip_low, clip_high)
    if objective == "gspo":
        return gspo(log_ratio, advantages, mask, clip_low, clip_high, seq_ids)
    if objective == "cispo":
        return cispo(log_ratio, advantages, clip_low, clip_high)
    raise ValueError(f"unknown objective {objective!r} ({' | '.join(OBJECTIVES)})")
