"""GRPO advantages and PPO-clip loss against independent float64 references written out per sample."""
import math

import pytest
import torch

from policies.grpo import group_advantages, policy_loss
from tests.builders import grpo_batch


def test_group_advantages_match_hand_computation_and_flag_zero_variance():
    rewards = torch.tensor([[1.0, 0.0, 0.1, 1.0], [0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 1.0]])
    adv, zero = group_advantages(rewards, normalize_std=True, eps=1e-6)
    assert zero.tolist() == [False, True, False]
    for g in (0, 2):
        r = [float(x) for x in rewards[g]]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        expect = [(x - mean) / (std + 1e-6) for x in r]
        assert adv[g].tolist() == pytest.approx(expect, rel=1e-6)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    plain, _ = group_advantages(rewards, normalize_std=False)
    assert plain[0].tolist() == pytest.approx([0.475, -0.525, -0.425, 0.475], rel=1e-6)


def test_group_advantages_single_sample_groups_carry_no_signal():
    adv, zero = group_advantages(torch.tensor([[0.3], [1.0]]))
    assert zero.tolist() == [True, True] and adv.abs().sum() == 0
    with pytest.raises(ValueError, match="groups, n"):
        group_advantages(torch.tensor([1.0, 0.0]))


def _reference(lp, old, adv, mask, gen, ref, ent, clip_low, clip_high, agg, kl_coef, entropy_coef, tis_cap):
    """Per sample, per token, in float64, straight from the PPO-clip / k3 / TIS definitions."""
    lp = lp.double()
    pg_terms, kl_terms, ent_terms = [], [], []
    for i in range(lp.shape[0]):
        pg_i, kl_i, ent_i = [], [], []
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            a = float(adv[i, t])
            r = torch.exp(lp[i, t] - float(old[i, t]))
            surrogate = torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high))
            w = min(math.exp(float(old[i, t]) - float(gen[i, t])), tis_cap) if tis_cap > 0 else 1.0
            pg_i.append(surrogate * w)
            d = float(ref[i, t]) - lp[i, t]
            kl_i.append(torch.exp(d) - d - 1)
            ent_i.append(torch.tensor(float(ent[i, t]), dtype=torch.float64))
        pg_terms.append(pg_i), kl_terms.append(kl_i), ent_terms.append(ent_i)

    def agg_fn(terms):
        if agg == "token-mean":
            flat = [x for seq in terms for x in seq]
            return sum(flat) / len(flat)
        seqs = [sum(seq) / len(seq) for seq in terms if seq]
        return sum(seqs) / len(seqs)

    return agg_fn(pg_terms) + kl_coef * agg_fn(kl_terms) - entropy_coef * agg_fn(ent_terms)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_coef,entropy_coef,tis_cap", [(0.0, 0.0, 0.0), (0.1, 0.01, 2.0)])
def test_loss_and_gradient_equal_float64_reference(agg, kl_coef, entropy_coef, tis_cap):
    lp, old, adv, mask, gen, ref, ent = grpo_batch()
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg, ref_logprobs=ref,
                                kl_coef=kl_coef, entropy=ent, entropy_coef=entropy_coef, gen_logprobs=gen,
                                tis_cap=tis_cap)
    loss.backward()
    x64 = lp.double().clone().requires_grad_(True)
    expect = _reference(x64, old, adv, mask, gen, ref, ent, 0.2, 0.28, agg, kl_coef, entropy_coef, tis_cap)
    expect.backward()
    assert float(loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-5, abs=1e-6)
    grad64 = torch.nan_to_num(x64.grad)
    assert torch.allclose(x.grad.double(), grad64, rtol=1e-4, atol=1e-6)
    assert x.grad[~mask].abs().sum() == 0  # padding gets no gradient
    assert metrics["clipfrac"] > 0  # the batch exercises clipping
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_with_minibatch_normaliser_equal_one_big_batch(agg):
    lp, old, adv, mask, *_ = grpo_batch(seed=3, samples=6)
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss(x, old, adv, mask, agg=agg)
    full.backward()
    g_full = x.grad.clone()
    x.grad = None
    normaliser = float(mask.sum()) if agg == "token-mean" else float(mask.shape[0])
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        part, _ = policy_loss(x[rows], old[rows], adv[rows], mask[rows], agg=agg, normalizer=normaliser)
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(full.detach()), rel=1e-6)
    assert torch.allclose(x.grad, g_full, atol=1e-7)


def test_flat_packed_tokens_with_seq_ids_equal_the_padded_layout():
    lp, old, adv, mask, *_ = grpo_batch(seed=5)
    seq = torch.arange(mask.shape[0])[:, None].expand_as(mask)
    padded, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean")
    flat, _ = policy_loss(lp[mask], old[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                          agg="seq-mean-token-mean", seq_ids=seq[mask])
    assert float(flat) == pytest.approx(float(padded), rel=1e-6)
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(lp[mask], old[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                    agg="seq-mean-token-mean")


def test_on_policy_ratio_is_exactly_one():
    _, old, adv, mask, *_ = grpo_batch(seed=1)
    old = torch.nan_to_num(old)
    loss, m = policy_loss(old.clone().requires_grad_(True), old, adv, mask)
    assert m["ratio_mean"] == 1.0 and m["ratio_max"] == 1.0
    assert m["ppo_kl"] == 0.0 and m["clipfrac"] == 0.0
    # On policy the loss is -mean(A) over tokens.
    assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-6)


def test_clip_higher_is_asymmetric():
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.25, 1.25, 0.75, 0.75]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    _, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # 1.25 < 1.28: a positive advantage is not clipped; 0.75 < 0.8 with A < 0 is.
    assert m["clipfrac_high"] == 0.0 and m["clipfrac_low"] == 0.25 and m["clipfrac"] == 0.25
    _, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert m["clipfrac_high"] == 0.25 and m["clipfrac"] == 0.5


def test_truncated_importance_weight_is_detached_and_capped():
    old = torch.zeros(3)
    gen = torch.tensor([0.0, -1.0, 2.0])  # weights exp(0)=1, exp(1)=2.7 -> cap 2, exp(-2)=0.135
    lp = torch.zeros(3, requires_grad=True)
    loss, m = policy_loss(lp, old, torch.ones(3), torch.ones(3, dtype=torch.bool), gen_logprobs=gen, tis_cap=2.0)
    loss.backward()
    w = [1.0, 2.0, math.exp(-2.0)]
    assert m["tis_weight_mean"] == pytest.approx(sum(w) / 3, rel=1e-6)
    assert lp.grad.tolist() == pytest.approx([-x / 3 for x in w], rel=1e-6)
    assert gen.grad is None


def test_mismatch_kl_is_the_k3_estimate_between_sampler_and_old_logprobs_over_completion_tokens():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    gen = torch.tensor([-1.2, -2.0, -0.4, 9.0])  # the last position is masked out (a prompt token)
    mask = torch.tensor([1, 1, 1, 0])
    _, m = policy_loss(old.clone(), old, torch.ones(4), mask, gen_logprobs=gen)
    d = (old - gen)[:3]
    assert m["mismatch_kl"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()), rel=1e-6) and m["mismatch_kl"] > 0
    _, same = policy_loss(old.clone(), old, torch.ones(4), mask, gen_logprobs=old.clone())
    assert same["mismatch_kl"] == 0.0
