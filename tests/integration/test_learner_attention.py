"""The learner's attention paths on CPU: varlen (one sdpa per sample) and segments (one sdpa per attention
segment) against the dense mask through the whole learner, the selection rule per device, and the torch varlen
call built for each torch's signature (against a fake varlen_attn: it has no CPU kernel)."""
import pytest
import torch

from actors.learner.learner import Learner
from config import LearnerConfig, ModelConfig
from tests.learners import TEMPERATURE, make_batch, sequences

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


def test_varlen_attention_through_the_learner_equals_the_masked_path(model_dir):
    """On CPU "varlen" runs one sdpa per sample, cut by the PackedBatch's cu_seqlens (no [T, T] mask)."""
    masked = Learner(LearnerConfig(zero_stage=0, dtype="float32", lr=1e-2, device="cpu", share_prompt=False),
                     ModelConfig(dtype="float32", attn_implementation="eager"), model_dir, total_steps=10,
                     micro_batch_tokens=64, temperature=TEMPERATURE)
    varlen = Learner(LearnerConfig(zero_stage=0, dtype="float32", lr=1e-2, device="cpu", share_prompt=False),
                     ModelConfig(dtype="float32", attn_implementation="varlen"), model_dir, total_steps=10,
                     micro_batch_tokens=64, temperature=TEMPERATURE)
    assert varlen.attn_implementation == "varlen" and masked.attn_implementation == "eager"
    seqs = sequences(make_batch(seed=16))
    for a, b in zip(masked.logprobs(seqs), varlen.logprobs(seqs)):
        assert torch.allclose(a, b, atol=1e-5)
    batch = make_batch(seed=17)
    ma, mb = masked.train_step(batch), varlen.train_step(batch)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("share", [False, True])
def test_segments_attention_through_the_learner_equals_the_dense_mask(model_dir, share):
    """On CPU the learner runs one sdpa per attention segment ("segments"); "eager" keeps the whole row's dense
    [T, T] mask: the same log-probs and the same step, unshared rows and shared prompts alike."""
    cfg = LearnerConfig(zero_stage=0, dtype="float32", lr=1e-2, device="cpu", share_prompt=share)
    dense, segments = (Learner(cfg, ModelConfig(dtype="float32", attn_implementation=impl), model_dir, total_steps=10,
                               micro_batch_tokens=64, temperature=TEMPERATURE) for impl in ("eager", "sdpa"))
    assert (dense.attn_implementation, segments.attn_implementation) == ("eager", "segments")
    seqs = sequences(make_batch(seed=16))
    for a, b in zip(dense.logprobs(seqs), segments.logprobs(seqs)):
        assert torch.allclose(a, b, atol=1e-5)
    batch = make_batch(seed=17)
    masked_blocks = [m is not None for it in segments._materialise(batch) for _, _, m in it["packed"].segment_blocks()]
    assert any(masked_blocks) == share and not all(masked_blocks)  # shared prompts' branches take a block mask
    ma, mb = dense.train_step(batch), segments.train_step(batch)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5) and mb["loss"] == pytest.approx(ma["loss"], rel=1e-5)


def test_attention_selection_prefers_varlen_on_cuda_without_flash_attn(monkeypatch):
    from actors.learner import attention

    assert attention.select_attn_implementation("sdpa", "cpu") == "segments"
    assert attention.select_attn_implementation("auto", "cpu") == "segments"
    assert attention.select_attn_implementation("eager", "cpu") == "eager"  # the dense mask, asked for by name
    assert attention.select_attn_implementation("varlen", "cpu") == "varlen"
    assert attention.select_attn_implementation("eager", "cuda") == "eager"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: True)
    assert attention.select_attn_implementation("sdpa", "cuda") == "varlen"
    assert attention.select_attn_implementation("auto", "cuda") == "varlen"
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: False)
    assert attention.select_attn_implementation("sdpa", "cuda") == "sdpa"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert attention.select_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert attention.select_attn_implementation("sdpa", "cuda") == "sdpa"


@pytest.mark.parametrize("torch_version", ["2.11", "2.13"])
def test_torch_varlen_call_matches_per_sample_sdpa_with_a_fake_varlen_attn_of_each_torch(monkeypatch, torch_version):
    """varlen_attn has no CPU kernel: a fake with the exact signature of torch 2.11 (is_causal, no GQA)
    or 2.13 (window_size, enable_gqa) computes per-sample sdpa, so the call _torch_varlen builds for
    that torch (causal flag, repeated or native GQA heads) is checked for real against the fallback."""
    import torch.nn.attention.varlen as varlen_mod

    from actors.learner import attention

    calls = []

    def reference(q, k, v, cu, scale, causal_ok, gqa):
        calls.append(gqa)
        assert causal_ok, "the call was not causal"
        if gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        assert q.shape[1] == k.shape[1], "GQA heads neither repeated nor declared"
        return attention._per_sample_sdpa(q, k, v, cu, scale)

    if torch_version == "2.11":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None, return_aux=None):
            return reference(query, key, value, cu_seq_q, scale, is_causal, False)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return reference(query, key, value, cu_seq_q, scale, tuple(window_size) == (-1, 0), enable_gqa)

    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(23, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 15, 23], dtype=torch.int32)
    got = attention._torch_varlen(q, k, v, cu, 8, 0.25)
    assert calls == [torch_version == "2.13"]
    torch.testing.assert_close(got, attention._per_sample_sdpa(q, k, v, cu, 0.25))
