"""Off-policy correction (policies.offpolicy + the decoupled objective in policies.grpo.policy_loss)
against float64 references written out per token and per sequence."""
import math

import pytest
import torch

from policies.grpo import policy_loss
from policies.offpolicy import importance_weights


def _batch(seed=0, samples=6, max_len=8, spread=0.8):
    """[B, L] log-probs: behaviour far enough from proximal that every mode truncates or masks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (samples,), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    prox = -torch.rand(samples, max_len, generator=g) * 3
    beh = prox + torch.randn(samples, max_len, generator=g) * spread
    beh[0] = prox[0] - 1.5  # one sample whose geometric-mean ratio is e^1.5 > 2: mis_seq drops it whole
    lp = prox + torch.randn(samples, max_len, generator=g) * 0.3
    adv = torch.randn(samples, 1, generator=g).expand(samples, max_len).contiguous()
    for t in (prox, beh, lp):
        t[~mask] = float("nan")  # padding garbage must never matter
    return lp, prox, beh, adv, mask


def _ref_weights(prox, beh, mask, mode, cap):
    """Per token, float64, from the definitions in policies/offpolicy.py's docstring."""
    w = [[1.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        logs = [float(prox[i, t]) - float(beh[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        seq_r = math.exp(sum(logs) / len(logs))
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(prox[i, t]) - float(beh[i, t]))
            if mode == "tis":
                w[i][t] = min(r, cap)
            elif mode == "mis":
                w[i][t] = r if 1 / cap <= r <= cap else 0.0
            elif mode == "mis_seq":
                w[i][t] = min(r, cap) if 1 / cap <= seq_r <= cap else 0.0
    return torch.tensor(w, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["tis", "mis", "mis_seq", "off"])
def test_weights_equal_float64_reference_on_rows_and_on_flat_packed_tokens(mode):
    _, prox, beh, _, mask = _batch()
    expect = _ref_weights(prox.double(), beh.double(), mask, mode, 2.0)
    w, m = importance_weights(prox.double(), beh.double(), mask, mode, 2.0)
    assert torch.allclose(w[mask], expect[mask], rtol=1e-12, atol=0)
    # The same tokens flattened (packed) with seq_ids give the same weights.
    seq_ids = torch.arange(mask.shape[0])[:, None].expand_as(mask)
    wf, mf = importance_weights(prox.double()[mask], beh.double()[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                                mode, 2.0, seq_ids=seq_ids[mask])
    assert torch.allclose(wf, expect[mask], rtol=1e-12, atol=0) and mf == pytest.approx(m)
    valid = expect[mask]
    r = torch.exp(prox.double()[mask] - beh.double()[mask])
    assert m["is_weight_mean"] == pytest.approx(float(valid.mean()), rel=1e-12)
    assert m["is_weight_max"] == pytest.approx(float(valid.max()), rel=1e-12)
    assert m["mismatch_kl"] == pytest.approx(float((r - 1 - torch.log(r)).mean()), rel=1e-12) and m["mismatch_kl"] > 0
    dropped = float((valid == 0).double().mean())
    assert m["is_masked_frac"] == pytest.approx(dropped)
    if mode == "tis":
        assert m["is_truncated_frac"] == pytest.approx(float((r > 2).double().mean())) and m["is_truncated_frac"] > 0
    if mode in ("mis", "mis_seq"):
        assert 0 < dropped < 1  # the batch exercises the mask
    if mode == "mis_seq":
        row0 = w[0][mask[0]]
        assert (row0 == 0).all() and m["is_masked_frac"] >= int(mask[0].sum()) / int(mask.sum())
    assert all(type(v) is float for v in m.values())


@pytest.mark.parametrize("mode", ["tis", "mis", "mis_seq"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_decoupled_loss_and_gradient_equal_float64_reference(mode, agg):
    """Ratio against the proximal policy, clip around it, times the behaviour weight; masked tokens
    keep their place in the normaliser."""
    lp, prox, beh, adv, mask = _batch(seed=1)
    x = lp.clone().requires_grad_(True)
    loss, m = policy_loss(x, prox, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg, gen_logprobs=beh,
                          correction=mode, is_cap=2.0)
    loss.backward()
    w = _ref_weights(prox.double(), beh.double(), mask, mode, 2.0)
    x64 = lp.double().clone().requires_grad_(True)
    per_seq = []
    for i in range(mask.shape[0]):
        terms = []
        for t in range(mask.shape[1]):
            if mask[i, t]:
                a, r = float(adv[i, t]), torch.exp(x64[i, t] - float(prox[i, t]))
                terms.append(torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28)) * float(w[i, t]))
        per_seq.append(terms)
    if agg == "token-mean":
        expect = sum(t for s in per_seq for t in s) / int(mask.sum())
    else:
        expect = sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    expect.backward()
    assert float(loss.detach()) == pytest.approx(float(expect), rel=1e-5, abs=1e-7)
    assert torch.allclose(x.grad.double(), torch.nan_to_num(x64.grad), rtol=1e-4, atol=1e-7)
    assert x.grad[~mask].abs().sum() == 0
    assert {"is_weight_mean", "is_weight_max", "is_truncated_frac", "is_masked_frac", "mismatch_kl"} <= set(m)


@pytest.mark.parametrize("mode", ["tis", "mis", "mis_seq", "off"])
def test_staleness_zero_with_identical_numerics_is_exactly_no_correction(mode):
    lp, prox, _, adv, mask = _batch(seed=2)
    w, m = importance_weights(prox, prox.clone(), mask, mode, 2.0)
    assert bool((w == 1.0).all())
    assert m["mismatch_kl"] == 0.0 and m["is_truncated_frac"] == 0.0 and m["is_masked_frac"] == 0.0
    assert m["is_weight_mean"] == 1.0 and m["is_weight_max"] == 1.0
    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    with_w, _ = policy_loss(x1, prox, adv, mask, gen_logprobs=prox.clone(), correction=mode)
    plain, _ = policy_loss(x2, prox, adv, mask)
    with_w.backward(), plain.backward()
    assert torch.equal(with_w, plain) and torch.equal(x1.grad, x2.grad)


def test_legacy_tis_cap_switch_still_works_and_none_still_reports_mismatch():
    lp, prox, beh, adv, mask = _batch(seed=3)
    legacy, m_legacy = policy_loss(lp, prox, adv, mask, gen_logprobs=beh, tis_cap=2.0)
    new, m_new = policy_loss(lp, prox, adv, mask, gen_logprobs=beh, correction="tis", is_cap=2.0)
    assert torch.equal(legacy, new) and m_legacy["tis_weight_mean"] == m_new["is_weight_mean"]
    off, m_off = policy_loss(lp, prox, adv, mask, gen_logprobs=beh, correction="off")
    plain, _ = policy_loss(lp, prox, adv, mask)
    assert torch.equal(off, plain) and m_off["mismatch_kl"] > 0 and "is_weight_mean" not in m_off


def test_bad_mode_or_cap_is_a_one_line_error_naming_it():
    _, prox, beh, _, mask = _batch()
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_weights(prox, beh, mask, "icepop")
    with pytest.raises(ValueError, match="mis cap must be > 1"):
        importance_weights(prox, beh, mask, "mis", 1.0)
    with pytest.raises(ValueError, match="need seq_ids"):
        importance_weights(prox[mask], beh[mask], mask[mask], "mis_seq")


def test_config_turns_correction_on_whenever_generation_can_be_off_policy(caplog):
    from config import ConfigError, apply_overrides
    from config.recipes import get_recipe

    tiny = get_recipe("tiny")  # colocated, transformers engine, float32 engine and learner
    assert apply_overrides(tiny, []).learner.correction == "off"
    for over in (["coordinator.mode=async", "assembler.max_staleness=1"], ["learner.dtype=bfloat16"],
                 ["generator.engine=vllm"]):
        cfg = apply_overrides(tiny, over)
        assert (cfg.learner.correction, cfg.learner.correction_cap) == ("tis", 2.0), over
    assert apply_overrides(tiny, ["learner.tis_cap=3"]).learner.correction_cap == 3.0  # the legacy switch
    mis = apply_overrides(tiny, ["learner.correction=mis_seq", "learner.correction_cap=1.5"]).learner
    assert (mis.correction, mis.correction_cap) == ("mis_seq", 1.5)
    with caplog.at_level("WARNING", logger="config"):
        off = apply_overrides(tiny, ["coordinator.mode=async", "assembler.max_staleness=2", "learner.correction=off"])
    assert off.learner.correction == "off" and "max_staleness=2" in caplog.text
    with pytest.raises(ConfigError, match="'learner.correction_cap'.*> 1"):
        apply_overrides(tiny, ["learner.correction=mis", "learner.correction_cap=1"])
    with pytest.raises(ConfigError, match="'learner.tis_cap'"):
        apply_overrides(tiny, ["learner.correction=mis", "learner.tis_cap=2"])
    with pytest.raises(ConfigError, match="learner.correction"):
        apply_overrides(tiny, ["learner.correction=icepop"])


