"""Token-budget packing: plans cover every sample once, and packed log-probs equal unpacked ones."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from policies.packing import (
    OversizedSampleWarning,
    block_causal_mask,
    pack,
    padding_fraction,
    plan_micro_batches,
    split_minibatches,
)


def test_plan_covers_every_sample_once_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)]
    plan = plan_micro_batches(lengths, 1024)
    assert sorted(i for mb in plan for i in mb) == list(range(200))
    assert all(sum(lengths[i] for i in mb) <= 1024 for mb in plan)
    assert plan == plan_micro_batches(lengths, 1024)  # deterministic
    # First-fit-decreasing stays within a few bins of the lower bound.
    assert len(plan) <= -(-sum(lengths) // 1024) + 1


def test_oversized_sample_gets_its_own_micro_batch_and_a_warning():
    with pytest.warns(OversizedSampleWarning, match="longer than the micro-batch budget"):
        plan = plan_micro_batches([10, 500, 20, 30], 100)
    assert [1] in plan
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2, 3]


def test_minibatches_partition_and_balance_tokens():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
    plan = plan_micro_batches(lengths, 100)
    mini = split_minibatches(plan, 2, lengths)
    assert sorted(j for m in mini for j in m) == list(range(len(plan)))
    loads = [sum(lengths[i] for j in m for i in plan[j]) for m in mini]
    assert max(loads) - min(loads) <= 100
    # Fewer micro-batches than asked: one micro-batch per minibatch, none empty.
    assert split_minibatches([[0], [1]], 4) == [[0], [1]]
    with pytest.raises(ValueError):
        split_minibatches(plan, 0)


def test_pack_layout_shift_and_index_maps():
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9]), ([10, 11], [])]
    pb = pack(seqs, pad_to_multiple_of=8)
    assert pb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]]
    assert pb.cu_seqlens.tolist() == [0, 5, 9, 11]
    # Position t predicts t+1: the last prompt token scores the first completion token.
    assert pb.target_ids[pb.loss_mask].tolist() == [4, 5, 7, 8, 9]
    assert pb.loss_mask.nonzero()[:, 1].tolist() == [2, 3, 5, 6, 7]
    assert pb.num_loss_tokens == 5 and pb.completion_lengths == [2, 3, 0]
    assert pb.sample_index[0, -5:].tolist() == [-1] * 5 and not pb.loss_mask[0, -5:].any()
    values = [torch.tensor([0.5, 0.25]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([])]
    assert [v.tolist() for v in pb.unpack(pb.scatter(values))] == [[0.5, 0.25], [1.0, 2.0, 3.0], []]
    adv = pb.scatter_per_sample([1.5, -2.0, 7.0])
    assert adv[pb.loss_mask].tolist() == [1.5, 1.5, -2.0, -2.0, -2.0] and adv[~pb.loss_mask].abs().sum() == 0
    with pytest.raises(ValueError, match="empty prompt"):
        pack([([], [1, 2])])


def test_block_causal_mask_never_crosses_samples():
    seg = torch.tensor([0, 0, 0, 1, 1, -1, -1])
    allowed = block_causal_mask(seg)[0, 0] == 0
    expect = torch.zeros(7, 7, dtype=torch.bool)
    expect[:3, :3] = torch.ones(3, 3).tril().bool()
    expect[3:5, 3:5] = torch.ones(2, 2).tril().bool()
    expect[5, 5] = expect[6, 6] = True
    assert torch.equal(allowed, expect)


@pytest.fixture(scope="module")
def tiny_models():
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, head_dim=16)
    out = {}
    for impl in ("sdpa", "eager"):
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        out[impl] = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return out


def _alone(model, prompt, completion):
    ids = torch.cat([prompt, completion])[None]
    logits = model(input_ids=ids, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
    return logp.gather(-1, completion[:, None])[:, 0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logprobs_equal_each_sample_alone(tiny_models, impl):
    model = tiny_models[impl]
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, 256, (p,), generator=g), torch.randint(0, 256, (c,), generator=g))
            for p, c in [(7, 5), (3, 9), (12, 1), (4, 6)]]
    pb = pack(seqs, pad_to_multiple_of=16)
    with torch.no_grad():
        logits = model(input_ids=pb.input_ids, position_ids=pb.position_ids,
                       attention_mask=pb.attention_mask(impl), use_cache=False).logits.float()
        packed = pb.unpack(torch.log_softmax(logits, -1).gather(-1, pb.target_ids[..., None])[..., 0])
        for (p, c), got in zip(seqs, packed):
            assert torch.allclose(got, _alone(model, p, c), atol=1e-5)
        # The test can fail: a plain causal mask over the row lets later samples see earlier ones.
        leaky = torch.zeros_like(pb.attention_mask(impl))
        t = pb.num_tokens
        leaky[0, 0].masked_fill_(~torch.ones(t, t, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
        logits = model(input_ids=pb.input_ids, position_ids=pb.position_ids, attention_mask=leaky,
                       use_cache=False).logits.float()
        wrong = pb.unpack(torch.log_softmax(logits, -1).gather(-1, pb.target_ids[..., None])[..., 0])
        assert not torch.allclose(wrong[1], _alone(model, *seqs[1]), atol=1e-3)


def test_flash_attention_uses_position_ids_not_a_mask():
    pb = pack([([1, 2], [3])])
    assert pb.attention_mask("flash_attention_2") is None
    assert pb.attention_mask("sdpa").shape == (1, 1, 3, 3)


def test_padding_fraction_counts_budget_slots():
    assert padding_fraction([50, 50, 100], [[0, 1], [2]], 100) == 0.0
    assert padding_fraction([50, 30], [[0], [1]], 100) == pytest.approx(0.6)


def test_varlen_cu_seqlens_cover_the_row_and_match_the_position_ids():
    from actors.learner.attention import cu_seqlens_from_position_ids

    pb = pack([([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10]), ([11, 12], [13])], pad_to_multiple_of=8)
    assert pb.num_tokens == 16 and pb.num_padding == 3
    kw = pb.varlen_kwargs()
    assert kw["cu_seq_lens_q"].tolist() == [0, 5, 10, 13, 16] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == 5 and kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    cu, m = cu_seqlens_from_position_ids(pb.position_ids)
    assert cu.tolist() == kw["cu_seq_lens_q"].tolist() and m == 5
    assert pb.attention_mask("varlen") is None
    unpadded = pack([([1, 2], [3])])
    assert unpadded.varlen_kwargs()["cu_seq_lens_q"].tolist() == [0, 3]


def test_varlen_attention_function_equals_one_causal_attention_per_sample():
    import torch.nn.functional as F

    from actors.learner.attention import varlen_attention_forward

    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 3]
    t = sum(lens)
    q, k, v = torch.randn(1, 4, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.3, position_ids=pos)
    assert out.shape == (1, t, 4, 8)
    a = 0
    for n in lens:
        ref = F.scaled_dot_product_attention(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n], is_causal=True,
                                             scale=0.3, enable_gqa=True)
        assert torch.allclose(out[0, a:a + n], ref[0].transpose(0, 1), atol=1e-6)
        a += n
