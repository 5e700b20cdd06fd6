"""The tiny learner the learner tests share (CPU, float32, a random two-layer Qwen3): the model, the Learner
built the tests' one way, hand-made train batches, and the parameter comparisons.

Invariant: nothing here starts a process or a Ray actor; building a Learner (make_learner) initialises
DeepSpeed in this process, so its callers are integration tests under the `learner_process_env` fixture.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from actors.learner.learner import Learner
from config import LearnerConfig, ModelConfig
from policies.packing import plan_micro_batches, split_minibatches
from policies.prefix import plan_group_micro_batches
from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids

TEMPERATURE = 0.7
MODEL_CFG = ModelConfig(dtype="float32", attn_implementation="sdpa")


def tiny_qwen3_dir(tmp_path_factory) -> str:
    """A random tiny Qwen3 (seed 0) saved in a fresh directory: the `model_dir` fixture's model."""
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, head_dim=16)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def make_learner(model_dir, **overrides):
    total_steps = overrides.pop("total_steps", 10)
    cfg = dict(zero_stage=0, dtype="float32", lr=1e-2, update_epochs=1, device="cpu", grad_clip=1.0)
    cfg.update(overrides)
    return Learner(LearnerConfig(**cfg), MODEL_CFG, model_dir, total_steps=total_steps,
                   micro_batch_tokens=64, temperature=TEMPERATURE)


def make_batch(seed=0, groups=3, n=4, budget=48, minibatches=1, step=0, gen_logprob=-5.0):
    g = torch.Generator().manual_seed(seed)
    tgroups = []
    for k in range(groups):
        prompt = torch.randint(0, 256, (int(torch.randint(6, 12, (1,), generator=g)),), generator=g)
        comps = [torch.randint(0, 256, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g) for _ in range(n)]
        tgroups.append(TrainGroup(
            prompt_id=f"p{k}", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
            gen_logprobs=[pack_floats(torch.full((len(c),), gen_logprob)) for c in comps],
            advantages=torch.randn(n, generator=g).tolist(), rewards=[0.0] * n, policy_version=0))
    pairs = [(gi, s) for gi in range(groups) for s in range(n)]
    lengths = [len(tgroups[gi].prompt_tokens) // 4 + len(tgroups[gi].completions[s]) // 4 for gi, s in pairs]
    plan = plan_micro_batches(lengths, budget)
    return TrainBatch(step=step, policy_version=0, groups=tgroups,
                      micro_batches=[[pairs[i] for i in mb] for mb in plan],
                      minibatches=split_minibatches(plan, minibatches, lengths))


def sequences(batch):
    """(prompt ids, completion ids) of every sample of a TrainBatch, as int64 tensors: Learner.logprobs' input."""
    from queues.messages import unpack_ids

    return [(torch.from_numpy(unpack_ids(grp.prompt_tokens).astype("int64")),
             torch.from_numpy(unpack_ids(c).astype("int64"))) for grp in batch.groups for c in grp.completions]


def params(learner):
    return {k: v.clone() for k, v in learner.state_dict_hf().items()}


def assert_params_close(a, b, atol):
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"parameters differ by {worst}"


def make_sharing_learner(model_dir, share: bool, **overrides):
    """make_learner with learner.share_prompt set: the shared-prefix tests' learner."""
    return make_learner(model_dir, share_prompt=share, **overrides)


def batch_of(groups, budget, share: bool, minibatches=1, step=0):
    prompts = [len(g.prompt_tokens) // 4 for g in groups]
    comps = [[len(c) // 4 for c in g.completions] for g in groups]
    if share:
        plan, tokens = plan_group_micro_batches(prompts, comps, budget)
        mbs = split_minibatches(plan, minibatches, tokens=tokens)
    else:
        pairs = [(gi, s) for gi in range(len(groups)) for s in range(len(comps[gi]))]
        lengths = [prompts[gi] + comps[gi][s] for gi, s in pairs]
        raw = plan_micro_batches(lengths, budget)
        plan, mbs = [[pairs[i] for i in mb] for mb in raw], split_minibatches(raw, minibatches, lengths)
        tokens = [sum(lengths[pairs.index(p)] for p in mb) for mb in plan]
    return TrainBatch(step=step, policy_version=0, groups=groups, micro_batches=plan, minibatches=mbs,
                      num_tokens=sum(tokens))


def per_sample_logprobs(learner, batch):
    """{(group, sample): log-probs} from the learner's own forward over its packed rows."""
    out = {}
    with torch.no_grad():
        for plan, it in zip(batch.micro_batches, learner._materialise(batch)):
            for pair, lp in zip(plan, it["packed"].unpack(learner._forward(it["packed"])[0])):
                out[pair] = lp
    return out


def assert_same_step(a, b, start, lr=1e-2):
    """One Adam step from equal gradients: all but a handful of elements within 1e-5 (Adam's first update
    is lr * g / (|g| + eps), so where |g| ~ eps a rounding-level difference in g shows), none more
    than a tenth of a step apart; and the step moved the weights far more than that."""
    diffs = torch.cat([(a[k] - b[k]).abs().reshape(-1) for k in a])
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert float((diffs > 1e-5).double().mean()) < 1e-3, f"{int((diffs > 1e-5).sum())} of {diffs.numel()} differ"
    assert float(diffs.max()) < 0.1 * lr < moved
