"""Multi-turn episodes in the learner (issue 24 points 3 and 5): observation tokens sit in the row as context
and never reach the loss, with and without learner.share_prompt (CPU, float32, tiny random Qwen3; float64
references), and what carries the masks there (Sample -> TrainGroup, schema 3, old messages). Packing and the loss
alone: tests/unit/test_episode_masks.py."""
from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.assembler import build_batch
from config import AssemblerConfig
from policies.offpolicy import importance_weights
from policies.prefix import group_runs, part_tokens
from queues.messages import (
    SCHEMA,
    PromptTask,
    RolloutGroup,
    Sample,
    ScoredGroup,
    TrainBatch,
    TrainGroup,
    codec,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
    unpack_loss_mask,
)
from tests.learners import TEMPERATURE, batch_of, per_sample_logprobs
from tests.learners import assert_same_step as _assert_same_step
from tests.learners import make_sharing_learner as make_learner

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process

def ids(t: bytes) -> torch.Tensor:
    return torch.from_numpy(unpack_ids(t).astype("int64"))


def episode_groups(seed=0, groups=2, n=4, gen_logprob=-5.0):
    """Groups of episodes: turns (mask 1, behaviour log-prob `gen_logprob`) with observations between them
    (mask 0, log-prob 0.0). Sample 0 of each group is one-shot with an empty mask (today's sample)."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    out = []
    for k in range(groups):
        prompt = torch.randint(0, 256, (rint(5, 10),), generator=g)
        comps, masks = [], []
        for s in range(n):
            pieces, mask = [], []
            for turn in range(1 if s == 0 else rint(2, 4)):
                if turn:
                    obs = torch.randint(0, 256, (rint(2, 6),), generator=g)
                    pieces.append(obs)
                    mask += [0] * len(obs)
                said = torch.randint(0, 256, (rint(1, 6),), generator=g)
                pieces.append(said)
                mask += [1] * len(said)
            comps.append(torch.cat(pieces))
            masks.append(torch.tensor(mask))
        out.append(TrainGroup(
            prompt_id=f"p{k}", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
            gen_logprobs=[pack_floats(torch.where(m.bool(), gen_logprob, 0.0)) for m in masks],
            advantages=torch.randn(n, generator=g).tolist(), rewards=[0.0] * n, policy_version=0,
            loss_masks=[b"" if s == 0 else pack_ids(m) for s, m in enumerate(masks)]))
    return out


def mask_of(group: TrainGroup, s: int) -> torch.Tensor:
    m = unpack_loss_mask(group.loss_masks[s], len(group.completions[s]) // 4) if group.loss_masks else None
    return torch.ones(len(group.completions[s]) // 4, dtype=torch.bool) if m is None else torch.from_numpy(m)


def with_masks(groups, masks):
    return [msgspec.structs.replace(g, loss_masks=list(m)) for g, m in zip(groups, masks)]


# ----------------------------------------------------------------------------- the learner

@pytest.fixture(scope="module")
def learners(model_dir):
    """(unshared, shared) learners that only run forwards here (never stepped)."""
    return make_learner(model_dir, share=False), make_learner(model_dir, share=True)


def test_shared_episodes_score_as_a_plain_forward_and_train_only_the_model_tokens(learners, model_dir):
    """Each episode is its sample's branch under the group's prompt once: its log-probs (observations
    included) equal a plain per-sequence forward within 1e-5 and the unshared row; the rows' loss
    positions are exactly the mask's ones."""
    plain, shared = learners
    groups = episode_groups(seed=1, groups=3, n=4)
    b_shared = batch_of(groups, 90, share=True)
    assert any(len(ss) > 1 for mb in b_shared.micro_batches for _, ss in group_runs(mb))  # rows really share
    got = per_sample_logprobs(shared, b_shared)
    unshared = per_sample_logprobs(plain, batch_of(groups, 90, share=False))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert set(got) == set(unshared) == {(g, s) for g in range(3) for s in range(4)}
    with torch.no_grad():
        for (g, s), lp in got.items():
            p, c = ids(groups[g].prompt_tokens), ids(groups[g].completions[s])
            logits = ref(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0].double() / TEMPERATURE
            expect = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, c[:, None])[:, 0]
            assert len(lp) == len(c)
            assert torch.allclose(lp.double(), expect, atol=1e-5, rtol=0), (g, s)
            assert torch.allclose(lp, unshared[(g, s)], atol=1e-5, rtol=0), (g, s)
    for share, learner, batch in ((True, shared, b_shared), (False, plain, batch_of(groups, 90, share=False))):
        items = learner._materialise(batch)
        for plan, it in zip(batch.micro_batches, items):
            pb = it["packed"]
            want = torch.cat([mask_of(groups[g], s) for g, s in plan])
            assert torch.equal(pb.loss_mask[0][pb.completion_mask[0]], want), share
            # behaviour log-probs: 0.0 on observations, which stay outside the loss positions
            assert (it["gen_logprobs"][0][pb.completion_mask[0] & ~pb.loss_mask[0]] == 0).all()
        total = sum(int(mask_of(g, s).sum()) for g in groups for s in range(4))
        assert sum(it["packed"].num_loss_tokens for it in items) == total
        assert total < sum(len(c) // 4 for g in groups for c in g.completions)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_one_shared_step_with_episodes_equals_the_unshared_step(model_dir, learners, zero_stage):
    """A group split over micro-batches, masks present: the same weights, loss, grad norm and token counts
    on both paths (each with its own plan)."""
    groups = episode_groups(seed=2, groups=3, n=5)
    b_shared = batch_of(groups, 60, share=True)
    assert [g for g in range(3) if sum(any(p[0] == g for p in mb) for mb in b_shared.micro_batches) > 1]
    b_plain = batch_of(groups, 60, share=False)
    assert b_shared.num_tokens < b_plain.num_tokens
    start = learners[0].state_dict_hf()  # never stepped
    kw = dict(zero_stage=zero_stage, correction="tis", correction_cap=2.0)
    m_shared = (ls := make_learner(model_dir, share=True, **kw)).train_step(b_shared)
    m_plain = (lp := make_learner(model_dir, share=False, **kw)).train_step(b_plain)
    _assert_same_step(ls.state_dict_hf(), lp.state_dict_hf(), start)
    for k in ("pg_loss", "loss", "grad_norm", "mismatch_kl", "is_weight_mean", "num_loss_tokens"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-8), k
    assert m_shared["num_loss_tokens"] == sum(int(mask_of(g, s).sum()) for g in groups for s in range(5))
    obs = sum(int((~mask_of(g, s)).sum()) for g in groups for s in range(5))
    assert m_shared["num_obs_tokens"] == m_plain["num_obs_tokens"] == obs > 0


def _captured_grads(learner):
    """Wrap the learner's optimizer step to keep each parameter's gradient (HF-named, float64) before it."""
    grads: dict[str, torch.Tensor] = {}
    step = learner._optimizer_step

    def capture():
        for name, p in learner.engine.module.named_parameters():
            grads[name.removeprefix("model.")] = p.grad.detach().double().clone()
        return step()

    learner._optimizer_step = capture
    return grads


def _reference_grads(model_dir, groups, masks, cap):
    """float64 gradient of the first (on-policy) step's token-mean TIS loss over the tokens `masks` keeps."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    total = sum(int(m.sum()) for ms in masks for m in ms)
    loss = 0.0
    for grp, ms in zip(groups, masks):
        p = ids(grp.prompt_tokens)
        for s, m in enumerate(ms):
            c = ids(grp.completions[s])
            gen = torch.from_numpy(unpack_floats(grp.gen_logprobs[s]).copy()).double()
            logits = ref(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0] / TEMPERATURE
            lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, c[:, None])[:, 0]
            w = torch.exp(lp.detach() - gen).clamp(max=cap)
            per_token = -grp.advantages[s] * torch.exp(lp - lp.detach()) * w
            loss = loss + (per_token * m.double()).sum() / total
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _rel(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    assert len(keys) > 5
    diff = torch.cat([(a[k] - b[k]).reshape(-1) for k in keys])
    return float(diff.norm() / torch.cat([b[k].reshape(-1) for k in keys]).norm())


def test_masked_observations_give_the_float64_gradient_of_the_model_tokens_alone(model_dir):
    """One shared-prompt step's gradient equals a float64 reference whose loss sums the model's tokens only
    (normalised by their count); a reference that trains the observations too is far from it."""
    groups = episode_groups(seed=3, groups=2, n=4)
    learner = make_learner(model_dir, share=True, correction="tis", correction_cap=2.0)
    grads = _captured_grads(learner)
    learner.train_step(batch_of(groups, 200, share=True))
    masks = [[mask_of(g, s) for s in range(4)] for g in groups]
    want = _reference_grads(model_dir, groups, masks, cap=2.0)
    assert _rel(grads, want) < 1e-4
    everything = [[torch.ones_like(m) for m in ms] for ms in masks]
    assert _rel(grads, _reference_grads(model_dir, groups, everything, cap=2.0)) > 0.05


def test_observation_tokens_with_log_prob_zero_never_enter_tis_or_mis(learners, model_dir):
    """Behaviour log-probs equal to the learner's own on the model's tokens and 0.0 on observations: the
    masked step reports no mismatch and masks nothing; the same rows without the masks would."""
    plain, _ = learners
    groups = episode_groups(seed=4, groups=2, n=4)
    batch = batch_of(groups, 200, share=True)
    true = per_sample_logprobs(plain, batch)
    for g, grp in enumerate(groups):
        grp.gen_logprobs = [pack_floats(torch.where(mask_of(grp, s), true[(g, s)], torch.zeros(()))) for s in range(4)]
    m = make_learner(model_dir, share=True, correction="mis", correction_cap=2.0).train_step(batch)
    assert m["mismatch_kl"] < 1e-6 and m["is_masked_frac"] == 0.0 and m["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    # the check can fail: with the observations counted, their 0.0 log-probs are masked by MIS
    unmasked = msgspec.structs.replace(batch, groups=with_masks(groups, [[] for _ in groups]))
    it = plain._materialise(unmasked)[0]
    pb = it["packed"]
    with torch.no_grad():
        old, _ = plain._forward(pb)
    _, metrics = importance_weights(old, it["gen_logprobs"], pb.loss_mask, "mis", 2.0, seq_ids=pb.sample_index)
    assert metrics["mismatch_kl"] > 0.5 and metrics["is_masked_frac"] > 0.1


def test_all_ones_masks_and_schema_2_batches_train_exactly_as_today(model_dir):
    """A mask of all ones (any packing) and an old, schema-2 TrainBatch (no loss_masks field) give
    bitwise the step of today's unmasked batch."""
    groups = episode_groups(seed=5, groups=2, n=3)
    today = with_masks(groups, [[] for _ in groups])
    ones = with_masks(groups, [[pack_ids([1] * (len(c) // 4)) for c in g.completions] for g in groups])

    class OldTrainGroup(msgspec.Struct, kw_only=True):  # schema 2's TrainGroup: no loss_masks
        prompt_id: str
        prompt_tokens: bytes
        completions: list[bytes]
        gen_logprobs: list[bytes]
        advantages: list[float]
        rewards: list[float]
        policy_version: int

    class OldTrainBatch(msgspec.Struct, kw_only=True):
        schema: int
        step: int
        policy_version: int
        groups: list[OldTrainGroup]
        micro_batches: list[list[tuple[int, int]]]
        minibatches: list[list[int]]

    plan = batch_of(today, 200, share=True)
    old = OldTrainBatch(schema=2, step=0, policy_version=0, micro_batches=plan.micro_batches, minibatches=plan.minibatches,
                        groups=[OldTrainGroup(**{f: getattr(g, f) for f in OldTrainGroup.__struct_fields__}) for g in today])
    decoded = codec(TrainBatch).decode(msgspec.msgpack.encode(old))
    assert decoded.schema == 2 and all(g.loss_masks == [] for g in decoded.groups)
    results = []
    for batch in (plan, msgspec.structs.replace(plan, groups=ones), decoded):
        learner = make_learner(model_dir, share=True, correction="tis", correction_cap=2.0)
        results.append((learner.train_step(batch), learner.state_dict_hf()))
    (m0, w0), *rest = results
    assert m0["num_obs_tokens"] == 0.0
    for m, w in rest:
        assert all(torch.equal(w0[k], w[k]) for k in w0)
        assert {k: v for k, v in m.items() if not k.endswith("_s")} == {k: v for k, v in m0.items() if not k.endswith("_s")}


def test_malformed_masks_are_refused_by_name(learners):
    plain, _ = learners
    groups = episode_groups(seed=6, groups=2, n=2)
    batch = batch_of(groups, 200, share=False)
    short = with_masks(groups, [groups[0].loss_masks, [groups[1].loss_masks[0], pack_ids([1, 0])]])
    with pytest.raises(ValueError, match=r"^TrainBatch.groups\[1\].loss_masks\[1\] has 2 entries for \d+ tokens$"):
        plain._materialise(msgspec.structs.replace(batch, groups=short))
    few = with_masks(groups, [groups[0].loss_masks[:1], groups[1].loss_masks])
    with pytest.raises(ValueError, match=r"^TrainBatch.groups\[0\].loss_masks has 1 entries for 2 samples$"):
        plain._materialise(msgspec.structs.replace(batch, groups=few))


def test_sft_triples_train_only_the_masked_in_targets(model_dir):
    """The warm start's (prompt, response, mask) triples: the step's loss is the mean cross-entropy over the
    masked-in tokens alone (float64 reference, temperature 1); pairs still mean all of them."""
    groups = episode_groups(seed=7, groups=2, n=3)
    triples = [(ids(g.prompt_tokens).tolist(), ids(c).tolist(), mask_of(g, s).int().tolist())
               for g in groups for s, c in enumerate(g.completions)]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def mean_nll(mask_them: bool) -> float:
        nll, n = 0.0, 0
        with torch.no_grad():
            for p, c, m in triples:
                logits = ref(input_ids=torch.tensor([p + c]), use_cache=False).logits[0]
                lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, torch.tensor(c)[:, None])[:, 0]
                keep = torch.tensor(m).bool() if mask_them else torch.ones(len(c), dtype=torch.bool)
                nll, n = nll - float(lp[keep].sum()), n + int(keep.sum())
        return nll / n

    assert make_learner(model_dir, share=False).sft_step(triples) == pytest.approx(mean_nll(True), rel=1e-5)
    assert make_learner(model_dir, share=False).sft_step([t[:2] for t in triples]) == pytest.approx(mean_nll(False), rel=1e-5)
    assert abs(mean_nll(True) - mean_nll(False)) > 1e-3
    with pytest.raises(ValueError, match=r"^sample 0: loss mask has 1 entries for \d+ completion tokens$"):
        make_learner(model_dir, share=False).sft_step([(triples[1][0], triples[1][1], [1])])


# ----------------------------------------------------------------------------- messages and the assembler

def _scored(task_id, masks):
    task = PromptTask(task_id=task_id, prompt_id=f"q{task_id}", step=0, policy_version=0,
                      prompt_tokens=pack_ids(range(5)), n=len(masks))
    samples = [Sample(tokens=pack_ids(range(len(m) or 3)), logprobs=pack_floats([-1.0] * (len(m) or 3)), finish_reason="stop",
                      loss_mask=pack_ids(m) if m else b"") for m in masks]
    return ScoredGroup(rollout=RolloutGroup(task=task, samples=samples, policy_version=0),
                       rewards=[float(i % 2) for i in range(len(masks))], verdicts=["match"] * len(masks))


@pytest.mark.parametrize("share", [False, True])
def test_the_assembler_copies_each_sample_s_mask_and_the_batch_round_trips(share):
    episodes = _scored("a", [[1, 1, 0, 0, 1], [], [1, 0, 1]])
    one_shot = _scored("b", [[], []])
    batch = build_batch(0, 0, [episodes, one_shot], AssemblerConfig(micro_batch_tokens=64, share_prompt=share))
    assert batch.groups[0].loss_masks == [s.loss_mask for s in episodes.rollout.samples]
    assert batch.groups[1].loss_masks == []  # no sample has a mask: the group is today's
    back = codec(TrainBatch).decode(codec(TrainBatch).encode(batch))
    assert back.schema == SCHEMA == 3 and back.groups[0].loss_masks == batch.groups[0].loss_masks
    # observations are in the rows; shared: each group's prompt once
    want = part_tokens(5, [5, 3, 3]) + part_tokens(5, [3, 3]) if share else (5 + 5) + 4 * (5 + 3)
    assert back.num_tokens == batch.num_tokens == want
    rg = codec(RolloutGroup).decode(codec(RolloutGroup).encode(episodes.rollout))
    assert unpack_loss_mask(rg.samples[0].loss_mask, 5).tolist() == [True, True, False, False, True]
