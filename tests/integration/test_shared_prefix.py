"""learner.share_prompt (issue 15): a group's prompt once per packed row, exactly the unshared log-probs,
loss and update (CPU, float32, tiny random Qwen3), and the group planner's contract."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from config import ConfigError
from policies.packing import OversizedSampleWarning, block_causal_mask, pack, split_minibatches
from policies.prefix import group_runs, pack_shared, part_tokens, plan_group_micro_batches
from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids, unpack_ids
from tests.learners import TEMPERATURE, batch_of, per_sample_logprobs
from tests.learners import assert_same_step as _assert_same_step
from tests.learners import make_sharing_learner as make_learner

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


# ----------------------------------------------------------------------------- layout and mask (pure)

def test_shared_row_keeps_every_packed_batch_contract():
    prompt, comps = [5, 6, 7, 8], [[1, 2], [3], [4, 4, 4], []]
    pb = pack_shared([(prompt, comps), ([9], [[1, 2]])])
    # trunk p0..p2, then [p3, c...] per response, positions continuing from the prompt
    assert pb.input_ids[0].tolist() == [5, 6, 7, 8, 1, 2, 8, 3, 8, 4, 4, 4, 8, 9, 1, 2]
    assert pb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 3, 4, 5, 6, 3, 0, 1, 2]
    assert pb.branch_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 0, 0, 0]
    assert pb.segment_ids[0].tolist() == [0] * 13 + [1] * 3
    assert pb.completion_lengths == [2, 1, 3, 0, 2] and pb.num_tokens == part_tokens(4, [2, 1, 3, 0]) + 3
    assert pb.shared and pb.cu_seqlens.tolist() == [0, 13, 16]
    # position t scores target_ids[t]; the loss positions are the completion tokens, in sample order
    lm = pb.loss_mask[0]
    assert pb.target_ids[0][lm].tolist() == [1, 2, 3, 4, 4, 4, 1, 2]
    assert pb.sample_index[0][lm].tolist() == [0, 0, 1, 2, 2, 2, 4, 4]
    assert pb.sample_index[0, :3].tolist() == [-1] * 3  # trunk: no sample, no loss
    vals = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(pb.completion_lengths)]
    assert [v.tolist() for v in pb.unpack(pb.scatter(vals))] == [v.tolist() for v in vals]
    adv = pb.scatter_per_sample([1.0, 2.0, 3.0, 4.0, 5.0])
    assert adv[0][lm].tolist() == [1, 1, 2, 3, 3, 3, 5, 5] and float(adv[0][~lm].abs().sum()) == 0.0
    # a part with one response is exactly pack()'s row
    one, ref = pack_shared([(prompt, [[1, 2]])], pad_to_multiple_of=8), pack([(prompt, [1, 2])], pad_to_multiple_of=8)
    for name in ("input_ids", "position_ids", "target_ids", "loss_mask", "sample_index", "token_index",
                 "segment_ids", "branch_ids"):
        assert torch.equal(getattr(one, name), getattr(ref, name)), name
    assert not one.shared and one.num_padding == ref.num_padding == 2
    with pytest.raises(ValueError, match="varlen"):
        pb.varlen_kwargs()


def test_mask_lets_each_response_see_its_prompt_and_itself_never_a_sibling():
    pb = pack_shared([([5, 6, 7], [[1, 2], [3, 4, 4]]), ([9, 9], [[1]])], pad_to_multiple_of=16)
    allowed = (pb.attention_mask("sdpa")[0, 0] == 0)
    seg, br = pb.segment_ids[0].tolist(), pb.branch_ids[0].tolist()
    for q in range(pb.num_tokens):
        for k in range(pb.num_tokens):
            if seg[q] < 0:
                want = q == k  # padding sees itself only
            else:
                want = seg[q] == seg[k] and k <= q and br[k] in (0, br[q])
            assert bool(allowed[q, k]) == want, (q, k)
    # all branches 0: the block-causal mask of the samples
    row = pack([([5, 6, 7], [1, 2]), ([9], [3])])
    assert torch.equal(block_causal_mask(row.sample_index[0]), row.attention_mask("eager"))


def test_flex_block_mask_equals_the_dense_mask():
    """actors/attention_flex on CPU (eager flex: a dense reference) gives sdpa's output with the dense
    mask, over a row of several 128-token tiles (full, partial and skipped ones; a ragged end)."""
    import torch.nn.functional as F

    from actors.learner.attention_flex import BLOCK, block_mask_for, block_tiles, flex_attention_forward

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 50, (n,), generator=g)  # noqa: E731
    pb = pack_shared([(ids(150), [ids(90), ids(3), ids(200)]), (ids(5), [ids(40)]), (ids(1), [ids(60), ids(7)])],
                     pad_to_multiple_of=8)
    t = pb.num_tokens
    assert t % BLOCK and t > 4 * BLOCK
    dense = pb.attention_mask("sdpa")[0, 0] == 0
    any_t, all_t = block_tiles(pb.segment_ids, pb.branch_ids)
    nb = -(-t // BLOCK)
    padded = torch.zeros(nb * BLOCK, nb * BLOCK, dtype=torch.bool)
    padded[:t, :t] = dense & (pb.segment_ids[0] >= 0)[:, None]
    tiles = padded.reshape(nb, BLOCK, nb, BLOCK)
    assert torch.equal(any_t, tiles.any(dim=(1, 3)))
    full = tiles.all(dim=(1, 3))
    assert torch.equal(all_t, full) and 0 < int(all_t.sum()) < int(any_t.sum()) < nb * nb
    q, k, v = (torch.randn(1, h, t, 16, generator=g) for h in (4, 2, 2))
    with pytest.warns(UserWarning):  # flex without torch.compile off CUDA (the dense reference)
        out, _ = flex_attention_forward(None, q, k, v, block_mask_for(pb), scaling=0.25)
    bm = block_mask_for(pb)
    assert bm is block_mask_for(pb)  # built once per row
    assert torch.equal(bm.to_dense()[0, 0].bool(), any_t)  # the kv-block lists say what the tiles say
    assert bm.full_kv_num_blocks[0, 0].tolist() == full.sum(-1).tolist()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=pb.attention_mask("sdpa"), scale=0.25, enable_gqa=True)
    real = pb.segment_ids[0] >= 0
    assert torch.allclose(out[0][real], ref.transpose(1, 2)[0][real], atol=1e-5)
    with pytest.raises(ValueError, match="BlockMask"):
        flex_attention_forward(None, q, k, v, None)


# ----------------------------------------------------------------------------- planner (pure)

def _check_plan(prompts, comps, budget, plan, tokens):
    pairs = [p for mb in plan for p in mb]
    assert sorted(pairs) == [(g, s) for g in range(len(comps)) for s in range(len(comps[g]))]  # each once
    for mb, t in zip(plan, tokens):
        runs = group_runs(mb)  # a group's samples contiguous (else ValueError)
        assert mb == sorted(mb)
        assert t == sum(part_tokens(prompts[g], [comps[g][s] for s in ss]) for g, ss in runs)
        assert t <= budget or len(mb) == 1
    assert tokens == sorted(tokens, reverse=True)


def test_group_planner_counts_the_prompt_once_and_splits_large_groups():
    import random

    rng = random.Random(0)
    for trial in range(30):
        prompts = [rng.randint(1, 60) for _ in range(rng.randint(1, 6))]
        comps = [[rng.randint(0, 50) for _ in range(rng.randint(1, 8))] for _ in prompts]
        budget = rng.randint(80, 300)
        with pytest.warns(OversizedSampleWarning) if any(p + c > budget for p, cs in zip(prompts, comps) for c in cs) \
                else _no_warning():
            plan, tokens = plan_group_micro_batches(prompts, comps, budget)
        _check_plan(prompts, comps, budget, plan, tokens)
    # BIRD-like: one group of 16 x 1,200 with a 3,000 prompt is 22,215 tokens shared (69,200 unshared)
    plan, tokens = plan_group_micro_batches([3000], [[1200] * 16], 32_768)
    assert tokens == [3000 - 1 + 16 * 1201] and len(plan) == 1
    # a group over the budget splits into parts, each with the prompt once
    plan, tokens = plan_group_micro_batches([100], [[60] * 6], 250)
    assert [len(mb) for mb in plan] == [2, 2, 2] and tokens == [99 + 2 * 61] * 3
    with pytest.warns(OversizedSampleWarning):
        plan, tokens = plan_group_micro_batches([100], [[10, 400]], 250)
    assert plan == [[(0, 1)], [(0, 0)]] and tokens == [500, 110]


def test_group_runs_refuse_a_group_listed_twice_naming_the_field():
    assert group_runs([(0, 0), (0, 2), (1, 0)]) == [(0, [0, 2]), (1, [0])]
    with pytest.raises(ValueError, match=r"^TrainBatch.micro_batches\[3\]: the samples of group 0 are not contiguous"):
        group_runs([(0, 0), (1, 0), (0, 1)], field="TrainBatch.micro_batches[3]")


def test_split_minibatches_balances_by_micro_batch_tokens():
    assert split_minibatches([[0], [1], [2], [3]], 2, tokens=[100, 60, 50, 10]) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="tokens"):
        split_minibatches([[0], [1]], 2, tokens=[1])


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", OversizedSampleWarning)

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


# ----------------------------------------------------------------------------- config

def test_config_derives_the_assembler_flag_and_refuses_incompatible_attention():
    from config import apply_overrides
    from config.recipes import tiny

    cfg = apply_overrides(tiny(), [])  # on by default
    assert cfg.learner.share_prompt and cfg.assembler.share_prompt
    assert not apply_overrides(tiny(), ["learner.share_prompt=false"]).assembler.share_prompt
    assert apply_overrides(tiny(), ["learner.share_prompt=false", "model.attn_implementation=varlen"])
    with pytest.raises(ConfigError, match=r"^config key 'model.attn_implementation': 'varlen' cannot express"):
        apply_overrides(tiny(), ["learner.share_prompt=true", "model.attn_implementation=varlen"])
    with pytest.raises(ConfigError, match=r"^config key 'assembler.share_prompt': set learner.share_prompt"):
        apply_overrides(tiny(), ["assembler.share_prompt=true"])
    from actors.learner.attention import select_attn_implementation

    assert select_attn_implementation("sdpa", "cpu", share_prompt=True) == "segments"
    assert select_attn_implementation("auto", "cuda", share_prompt=True) == "prefix_flex"
    with pytest.raises(ValueError, match="flash_attention_2"):
        select_attn_implementation("flash_attention_2", "cuda", share_prompt=True)


# ----------------------------------------------------------------------------- the learner

def make_groups(seed=0, groups=3, n=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = torch.randint(0, 256, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g)
        comps = [torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g) for _ in range(n)]
        out.append(TrainGroup(
            prompt_id=f"p{k}", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
            gen_logprobs=[pack_floats(torch.full((len(c),), -5.0)) for c in comps],
            advantages=torch.randn(n, generator=g).tolist(), rewards=[0.0] * n, policy_version=0))
    return out


@pytest.fixture(scope="module")
def learners(model_dir):
    return make_learner(model_dir, share=False), make_learner(model_dir, share=True)


def test_shared_logprobs_equal_unshared_and_an_independent_forward(learners, model_dir):
    plain, shared = learners
    groups = make_groups(seed=1)
    b_shared = batch_of(groups, 70, share=True)
    assert any(len(group_runs(mb)[0][1]) > 1 for mb in b_shared.micro_batches)  # some rows really share
    got = per_sample_logprobs(shared, b_shared)
    items = shared._materialise(b_shared)
    assert sum(it["packed"].num_tokens for it in items) == b_shared.num_tokens  # the planner's count is the row's
    unshared = per_sample_logprobs(plain, batch_of(groups, 70, share=False))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert set(got) == set(unshared) == {(g, s) for g in range(3) for s in range(4)}
    with torch.no_grad():
        for (g, s), lp in got.items():
            p = torch.from_numpy(unpack_ids(groups[g].prompt_tokens).astype("int64"))
            c = torch.from_numpy(unpack_ids(groups[g].completions[s]).astype("int64"))
            logits = ref(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0].double() / TEMPERATURE
            expect = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, c[:, None])[:, 0]
            assert torch.allclose(lp.double(), expect, atol=1e-5, rtol=0), (g, s)
            assert torch.allclose(lp, unshared[(g, s)], atol=1e-5, rtol=0), (g, s)
    # The check can fail: a mask that lets siblings see each other (branches dropped) moves them.
    it = items[0]
    pb = it["packed"]
    leaky = type(pb)(**{k: v for k, v in pb.__dict__.items() if k != "attn_cache"})
    leaky.branch_ids = torch.zeros_like(pb.branch_ids)
    with torch.no_grad():
        a, b = (torch.cat(x.unpack(shared._forward(x)[0])) for x in (pb, leaky))
    assert float((a - b).abs().max()) > 1e-2


def _one_step_weights(model_dir, share: bool, batch, **overrides):
    learner = make_learner(model_dir, share=share, **overrides)
    m = learner.train_step(batch)
    return learner.state_dict_hf(), m


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_one_step_equals_the_unshared_step_with_a_group_split_across_micro_batches(model_dir, learners, zero_stage):
    """Shared plan (a group split over micro-batches, 2 minibatches) vs the per-sample plan: the same
    weights, metrics and grad norm; a sibling-visible mask would fail it (checked in the log-prob test)."""
    groups = make_groups(seed=2, groups=3, n=6)
    b_shared = batch_of(groups, 40, share=True, minibatches=1)
    split = [g for g in range(3) if sum(any(p[0] == g for p in mb) for mb in b_shared.micro_batches) > 1]
    assert split, "no group was split across micro-batches"
    b_plain = batch_of(groups, 40, share=False, minibatches=1)
    assert b_shared.num_tokens < b_plain.num_tokens
    start = learners[0].state_dict_hf()  # never stepped
    w_shared, m_shared = _one_step_weights(model_dir, True, b_shared, zero_stage=zero_stage)
    w_plain, m_plain = _one_step_weights(model_dir, False, b_plain, zero_stage=zero_stage)
    _assert_same_step(w_shared, w_plain, start)
    assert m_shared["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    for k in ("pg_loss", "loss", "mismatch_kl", "num_loss_tokens"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-8), k
    assert m_shared["num_tokens"] == b_shared.num_tokens < m_plain["num_tokens"]


def test_seq_level_correction_and_minibatches_match_too(model_dir, learners):
    """mis_seq (per-sample masks through seq_ids=sample_index: every other sample's behaviour log-probs
    are off by 1 nat, so it is masked) and seq-mean-token-mean, 2 minibatches with the same split on
    both paths: the same weights after two optimizer steps."""
    groups = make_groups(seed=3, groups=2, n=5)
    b_shared = batch_of(groups, 64, share=True, minibatches=2)
    true = per_sample_logprobs(learners[0], b_shared)
    for g, grp in enumerate(groups):
        grp.gen_logprobs = [pack_floats((true[(g, s)] + (s % 2)).numpy()) for s in range(len(grp.completions))]
    assert len(b_shared.minibatches) == 2
    kw = dict(correction="mis_seq", correction_cap=1.5, loss_agg="seq-mean-token-mean", lr=1e-3)
    start = learners[0].state_dict_hf()  # never stepped
    w_shared, m_shared = _one_step_weights(model_dir, True, b_shared, **kw)
    w_plain, m_plain = _one_step_weights(model_dir, False, b_shared, **kw)  # same pairs, unshared rows
    _assert_same_step(w_shared, w_plain, start, lr=1e-3)
    assert m_shared["optimizer_steps"] == 2.0 and 0 < m_plain["is_masked_frac"] < 1
    for k in ("pg_loss", "is_masked_frac", "grad_norm", "mismatch_kl"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-8), k


def test_a_micro_batch_listing_a_group_non_contiguously_is_refused_by_name(learners):
    _, shared = learners
    groups = make_groups(seed=4, groups=2, n=2)
    bad = TrainBatch(step=0, policy_version=0, groups=groups, micro_batches=[[(0, 0), (1, 0), (0, 1)], [(1, 1)]],
                     minibatches=[[0, 1]])
    with pytest.raises(ValueError, match=r"^TrainBatch.micro_batches\[0\]: the samples of group 0 are not contiguous"):
        shared.train_step(bad)


def test_assembler_plans_groups_with_the_prompt_counted_once():
    from actors.assembler import build_batch
    from config import AssemblerConfig
    from tests.builders import scored

    groups = [scored(str(i), [1.0, 0.0, 0.1, 0.5], completion_len=3 + i) for i in range(4)]  # prompts of 5
    plain = build_batch(0, 0, groups, AssemblerConfig(micro_batch_tokens=30))
    shared = build_batch(0, 0, groups, AssemblerConfig(micro_batch_tokens=30, share_prompt=True, minibatches_per_step=2))
    assert plain.num_tokens == sum(4 * (5 + 3 + i) for i in range(4))
    # groups 0-2 whole (20, 24, 28 tokens); group 3 (32 > 30) in two parts, each with its prompt
    whole = sum(part_tokens(5, [3 + i] * 4) for i in range(3))
    assert shared.num_tokens == whole + part_tokens(5, [6] * 3) + part_tokens(5, [6]) < plain.num_tokens
    assert sorted(p for mb in shared.micro_batches for p in mb) == [(g, s) for g in range(4) for s in range(4)]
    assert sum(len(group_runs(mb)) for mb in shared.micro_batches) == 5
    assert sorted(i for m in shared.minibatches for i in m) == list(range(len(shared.micro_batches)))
