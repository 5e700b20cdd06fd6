"""policies.objectives (ppo_clip, gspo, cispo) and Dr.GRPO's aggregation, against float64 references
written out per sample and per token from each paper's formula."""
import math

import pytest
import torch

from policies.grpo import policy_loss
from policies.objectives import surrogate
from tests.builders import grpo_batch


def _batch(seed=0, samples=6, spread=0.4):
    lp, old, adv, mask, gen, _, _ = grpo_batch(seed=seed, samples=samples, spread=spread)
    return lp, old, adv, mask, gen


def _is_weight(old, gen, correction, cap):
    """The behaviour-policy weight of policies.offpolicy by its definition: TIS truncates, MIS zeroes."""
    r = math.exp(old - gen)
    if correction == "tis":
        return min(r, cap)
    if correction == "mis":
        return 0.0 if r < 1 / cap or r > cap else r
    return 1.0


def _reference(objective, agg, lp, old, adv, mask, gen, clip_low, clip_high, correction, norm_tokens, cap=2.0):
    """Per sample, per token, float64, straight from the formulas in policies/objectives.py's docstrings."""
    seqs = []
    for i in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if mask[i, t]]
        a = float(adv[i, 0])
        terms = []
        if objective == "gspo":
            s = torch.exp(sum(lp[i, t] - float(old[i, t]) for t in toks) / len(toks))
            val = torch.maximum(-a * s, -a * torch.clamp(s, 1 - clip_low, 1 + clip_high))
            terms = [val for _ in toks]
        for t in toks if objective != "gspo" else []:
            r = torch.exp(lp[i, t] - float(old[i, t]))
            if objective == "ppo_clip":
                terms.append(torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)))
            else:  # cispo: -sg(clip(r)) * A * log pi, its value shifted to -w A (same gradient)
                w = min(max(float(r.detach()), 1 - clip_low), 1 + clip_high)
                terms.append(-w * a * (lp[i, t] - float(lp[i, t])) - w * a)
        terms = [x * _is_weight(float(old[i, t]), float(gen[i, t]), correction, cap) for x, t in zip(terms, toks)]
        seqs.append(terms)
    if agg == "token-mean":
        flat = [x for s in seqs for x in s]
        return sum(flat) / len(flat)
    if agg == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    return sum(sum(s) for s in seqs) / (len(seqs) * norm_tokens)  # Dr.GRPO


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("correction", ["off", "tis", "mis"])
def test_loss_and_gradient_equal_float64_reference(objective, agg, correction):
    lp, old, adv, mask, gen = _batch()
    clip_low, clip_high = (0.05, 0.08) if objective == "gspo" else (0.2, 0.28)
    x = lp.clone().requires_grad_(True)
    loss, m = policy_loss(x, old, adv, mask, clip_low=clip_low, clip_high=clip_high, agg=agg, gen_logprobs=gen,
                          correction=correction, is_cap=1.3, objective=objective, norm_tokens=16.0)
    loss.backward()
    x64 = lp.double().clone().requires_grad_(True)
    expect = _reference(objective, agg, x64, old, adv, mask, gen, clip_low, clip_high, correction, 16.0, cap=1.3)
    expect.backward()
    assert float(loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-5, abs=1e-6)
    assert torch.allclose(x.grad.double(), torch.nan_to_num(x64.grad), rtol=1e-4, atol=1e-6)
    assert x.grad[~mask].abs().sum() == 0
    assert 0 < m["clipfrac"] < 1  # the batch exercises the clip (and leaves some tokens unclipped)
    if correction != "off":  # and the correction: some weights truncated (tis) or tokens dropped (mis)
        assert m["is_truncated_frac" if correction == "tis" else "is_masked_frac"] > 0
    assert all(type(v) is float for v in m.values())


def test_cispo_keeps_a_gradient_on_clipped_tokens_where_ppo_clip_drops_it():
    lp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 (above 1.28) and 0.5 (below 0.8)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0]])
    grads = {}
    for obj in ("ppo_clip", "cispo"):
        x = lp.clone().requires_grad_(True)
        policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, objective=obj)[0].backward()
        grads[obj] = x.grad
    assert grads["ppo_clip"][0, 0] == 0  # A > 0, ratio above 1 + clip_high: PPO's gradient is zero
    assert grads["cispo"][0].tolist() == pytest.approx([-1.28 / 2, -0.8 / 2])  # -clip(r) A / T


def test_gspo_sequence_ratio_ignores_masked_tokens():
    lp, old, adv, mask, _ = _batch(seed=2)
    changed = lp.clone()
    changed[~mask] = 5.0  # a masked token's log-prob (observation / padding) moves
    a = surrogate("gspo", torch.where(mask, lp - old, 0), adv, mask, 0.1, 0.1)[0]
    b = surrogate("gspo", torch.where(mask, changed - old, 0), adv, mask, 0.1, 0.1)[0]
    assert torch.equal(a[mask], b[mask])


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
def test_on_policy_every_objective_is_the_same_reinforce_gradient(objective):
    _, old, adv, mask, _ = _batch(seed=4)
    old = torch.nan_to_num(old)
    grads = []
    for obj in ("ppo_clip", objective):
        x = old.clone().requires_grad_(True)
        loss, m = policy_loss(x, old, adv, mask, agg="seq-mean-token-mean", objective=obj)
        loss.backward()
        grads.append(x.grad)
        assert m["clipfrac"] == 0.0 and m["ratio_mean"] == 1.0
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_minibatch_normaliser_equal_one_big_batch(objective, agg):
    lp, old, adv, mask, _ = _batch(seed=3)
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss(x, old, adv, mask, agg=agg, objective=objective, norm_tokens=12.0)
    full.backward()
    g_full, x.grad = x.grad.clone(), None
    normaliser = float(mask.sum()) if agg == "token-mean" else float(mask.shape[0])
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        part, _ = policy_loss(x[rows], old[rows], adv[rows], mask[rows], agg=agg, normalizer=normaliser,
                              objective=objective, norm_tokens=12.0)
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(full.detach()), rel=1e-6)
    assert torch.allclose(x.grad, g_full, atol=1e-7)


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_flat_packed_tokens_with_seq_ids_equal_the_padded_layout(objective):
    lp, old, adv, mask, _ = _batch(seed=5)
    seq = torch.arange(mask.shape[0])[:, None].expand_as(mask)
    padded, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", objective=objective, norm_tokens=9.0)
    flat, _ = policy_loss(lp[mask], old[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                          agg="seq-mean-token-sum-norm", seq_ids=seq[mask], objective=objective, norm_tokens=9.0)
    assert float(flat) == pytest.approx(float(padded), rel=1e-6)


def test_bad_names_and_a_missing_constant_are_refused():
    lp, old, adv, mask, _ = _batch()
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        policy_loss(lp, old, adv, mask, objective="ppo")
    with pytest.raises(ValueError, match="norm_tokens"):
        policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm")


def test_config_values_and_their_one_line_errors():
    from config import ConfigError
    from config.validate import validate
    cfg = validate({"learner": {"loss": "gspo", "loss_agg": "seq-mean-token-sum-norm"},
                    "generator": {"max_tokens": 96}})
    assert cfg.learner.loss == "gspo" and cfg.learner.loss_norm_tokens == 96
    assert validate({"learner": {"loss_agg": "seq-mean-token-sum-norm", "loss_norm_tokens": 40}}).learner.loss_norm_tokens == 40
    assert validate({}).learner.loss == "ppo_clip"
    for bad, key in (({"loss": "ppo"}, "learner.loss"), ({"loss_norm_tokens": -1}, "learner.loss_norm_tokens"),
                     ({"clip_low": 1.5}, "learner.clip_low"), ({"clip_high": -0.1}, "learner.clip_high")):
        with pytest.raises(ConfigError, match=key) as e:
            validate({"learner": bad})
        assert "\n" not in str(e.value)
