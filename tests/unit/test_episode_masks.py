"""Multi-turn episodes' loss masks without a learner (issue 24 points 3 and 5): packing carries each sample's mask
(pack and pack_shared alike, all-ones and absent masks the same row, a wrong length one line naming the sample), and
the loss of a masked batch is exactly that of the batch with the observation span cut (float64). The learner's side:
tests/integration/test_episode_learner.py."""
from __future__ import annotations

import pytest
import torch

from policies.grpo import policy_loss
from policies.packing import pack
from policies.prefix import pack_shared
from queues.messages import pack_ids, unpack_loss_mask

ROW_FIELDS = ("input_ids", "position_ids", "target_ids", "loss_mask", "completion_mask", "sample_index",
              "token_index", "segment_ids", "branch_ids")


# ----------------------------------------------------------------------------- packing (pure)

def test_pack_and_pack_shared_carry_the_mask_and_keep_the_sample_structure():
    prompt = [5, 6, 7]
    comps = [[1, 2, 3, 4], [8, 9], [10, 11, 12]]
    masks = [[1, 0, 0, 1], None, torch.tensor([0, 1, 1])]
    for pb in (pack([(prompt, c, m) for c, m in zip(comps, masks)], pad_to_multiple_of=8),
               pack_shared([(prompt, comps, masks)], pad_to_multiple_of=8)):
        lm, cm = pb.loss_mask[0], pb.completion_mask[0]
        # every completion token is scored (unpack / scatter over all of them); only the model's are trained
        assert pb.target_ids[0][cm].tolist() == [1, 2, 3, 4, 8, 9, 10, 11, 12]
        assert pb.target_ids[0][lm].tolist() == [1, 4, 8, 9, 11, 12]
        assert pb.sample_index[0][lm].tolist() == [0, 0, 1, 1, 2, 2] and not (lm & ~cm).any()
        assert pb.num_loss_tokens == 6 and pb.completion_lengths == [4, 2, 3]
        vals = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(pb.completion_lengths)]
        assert [v.tolist() for v in pb.unpack(pb.scatter(vals))] == [v.tolist() for v in vals]
        adv = pb.scatter_per_sample([1.0, 2.0, 3.0])
        assert adv[0][cm].tolist() == [1] * 4 + [2] * 2 + [3] * 3
        moved = pb.to("cpu")
        assert torch.equal(moved.loss_mask, pb.loss_mask) and torch.equal(moved.completion_mask, pb.completion_mask)


def test_all_ones_and_absent_masks_pack_the_same_row():
    prompt, comps = [5, 6, 7, 8], [[1, 2], [3], [4, 4, 4]]
    ones = [[1] * len(c) for c in comps]
    for a, b in ((pack([(prompt, c) for c in comps]), pack([(prompt, c, m) for c, m in zip(comps, ones)])),
                 (pack_shared([(prompt, comps)]), pack_shared([(prompt, comps, ones)])),
                 (pack_shared([(prompt, comps)]), pack_shared([(prompt, comps, [None] * 3)]))):
        for name in ROW_FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_mask_of_the_wrong_length_is_a_one_line_error_naming_the_sample():
    with pytest.raises(ValueError, match=r"^sample 1: loss mask has 2 entries for 3 completion tokens$"):
        pack([([1], [2]), ([1], [2, 3, 4], [1, 0])])
    with pytest.raises(ValueError, match=r"^sample 2: loss mask has 1 entries for 2 completion tokens$"):
        pack_shared([([1, 2], [[3]]), ([1], [[2], [3, 4]], [None, [1]])])
    with pytest.raises(ValueError, match=r"^part 0 has 1 loss masks for 2 completions$"):
        pack_shared([([1, 2], [[3], [4]], [None])])
    with pytest.raises(ValueError, match=r"^Sample.loss_mask has 2 entries for 3 tokens$"):
        unpack_loss_mask(pack_ids([1, 0]), 3, field="Sample.loss_mask")
    with pytest.raises(ValueError, match=r"^Sample.loss_mask holds values other than 0 and 1$"):
        unpack_loss_mask(pack_ids([1, 2]), 2, field="Sample.loss_mask")
    assert unpack_loss_mask(b"", 5) is None and unpack_loss_mask(pack_ids([0, 1]), 2).tolist() == [False, True]


# ----------------------------------------------------------------------------- the loss (pure, float64)

def _flat_tokens(seed=0):
    """Three packed samples' per-token tensors (float64) and a mask with an observation span in two of them."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([0] * 7 + [1] * 5 + [2] * 9)
    n = len(seq)
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    beh = prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    lp = (prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    adv = torch.tensor([0.7, -1.1, 0.4], dtype=torch.float64)[seq]
    ref = prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    keep = torch.ones(n, dtype=torch.bool)
    keep[[2, 3, 4, 15, 16]] = False  # observations: in the row, out of the loss
    beh = torch.where(keep, beh, torch.zeros_like(beh))  # and their behaviour log-prob is 0.0
    return lp, prox, beh, adv, ref, ent, seq, keep


@pytest.mark.parametrize("correction", ["tis", "mis", "mis_seq"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_masked_span_is_exactly_the_batch_with_that_span_cut(correction, agg):
    """Loss, gradient and every metric of the masked tokens equal those of the same tokens with the
    observation span cut out (float64); the span's gradient is exactly 0; and the span, were it in the
    loss, would change them (the check can fail)."""
    lp, prox, beh, adv, ref, ent, seq, keep = _flat_tokens()
    kw = dict(agg=agg, kl_coef=0.1, entropy_coef=0.01, correction=correction, is_cap=2.0)

    def run(sel, mask):
        x = lp.detach()[sel].clone().requires_grad_()
        loss, m = policy_loss(x, prox[sel], adv[sel], mask, ref_logprobs=ref[sel], entropy=ent[sel],
                              gen_logprobs=beh[sel], seq_ids=seq[sel], **kw)
        loss.backward()
        return loss.detach(), x.grad, m

    everything = torch.ones_like(keep)
    masked, g_masked, m_masked = run(everything, keep)
    cut, g_cut, m_cut = run(keep, torch.ones(int(keep.sum()), dtype=torch.bool))
    assert float(masked) == pytest.approx(float(cut), rel=1e-12, abs=1e-15)
    assert torch.allclose(g_masked[keep], g_cut, rtol=1e-12, atol=1e-15)
    assert (g_masked[~keep] == 0).all()
    assert m_masked == pytest.approx(m_cut, rel=1e-12, abs=1e-15) and m_masked["num_tokens"] == int(keep.sum())
    unmasked, g_all, m_all = run(everything, everything)
    assert abs(float(unmasked) - float(cut)) > 1e-3 and (g_all[~keep] != 0).all()
    assert m_all["mismatch_kl"] > m_masked["mismatch_kl"] + 0.1  # log-prob 0.0 against ~-1.5: far off
