"""LoRA RL on CPU with the real parts (transformers, peft, DeepSpeed ZeRO-0, the object-store transport):
only the adapter trains and is in the optimizer; a weight sync moves the adapter's bytes alone, and after it
the transformers engine's outputs change and equal the learner's; a sync that moves no adapter tensor fails
(verl #7495) instead of passing for a new policy; a checkpoint holds the adapter alone and resumes exactly; an
export is a PEFT adapter the engine serves as the learner computed it, and merges into a plain model."""

import pytest
import torch

from actors import lora
from actors.coordinator.export import read_settings
from actors.engines.hf import TransformersEngine
from actors.learner import weights_out
from actors.learner.learner import Learner
from config import GeneratorConfig, LearnerConfig, LoraConfig, ModelConfig
from queues.messages import PromptTask, TrainBatch, TrainGroup, pack_floats, pack_ids, unpack_floats, unpack_ids
from weights.base import drive_bucketed_sync
from weights.store import ObjectStoreReceiver, ObjectStoreSender
from weights.wire import SyncSummary

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process
torch.set_num_threads(1)

MODEL_CFG = ModelConfig(source="tiny", dtype="float32")
LORA = LoraConfig(rank=4, alpha=8.0)
PROMPT, TARGET = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]


def make_learner(model_dir, lora_cfg=LORA, **overrides):
    cfg = dict(zero_stage=0, dtype="float32", lr=3e-2, device="cpu", grad_clip=1.0, lora=lora_cfg)
    cfg.update(overrides)
    torch.manual_seed(0)  # the adapter's lora_A init
    return Learner(LearnerConfig(**cfg), MODEL_CFG, model_dir, total_steps=10, micro_batch_tokens=256,
                   temperature=1.0)


def make_engine(model_dir, lora_cfg=LORA):
    gen = GeneratorConfig(engine="transformers", device="cpu", max_tokens=len(TARGET), n_samples=1, temperature=0.0,
                          lora=lora_cfg)
    return TransformersEngine(gen, MODEL_CFG, model_dir)


def rl_batch(step=0):
    """One GRPO group after PROMPT: TARGET with advantage +1, another answer with -1."""
    comps = [TARGET, [20, 21, 22, 23, 24, 25, 26, 27]]
    group = TrainGroup(prompt_id="p", prompt_tokens=pack_ids(PROMPT), completions=[pack_ids(c) for c in comps],
                       gen_logprobs=[pack_floats([-5.0] * len(c)) for c in comps], advantages=[1.0, -1.0],
                       rewards=[1.0, 0.0], policy_version=0)
    return TrainBatch(step=step, policy_version=0, groups=[group], micro_batches=[[(0, 0), (0, 1)]], minibatches=[[0]])


def teach(learner, steps=12):
    """GRPO steps toward TARGET after PROMPT (the adapter moves), so the greedy answer moves."""
    for _ in range(steps):
        learner.train_step(rl_batch(learner.step))


async def sync(learner, engine, version, bucket_mb=0.01) -> SyncSummary:
    """One whole object-store sync learner -> engine, as the coordinator drives it (identity put/get)."""
    sender = ObjectStoreSender(learner.export_weights, bucket_mb, put=lambda x: x)
    receiver = ObjectStoreReceiver(engine.load_weights, get=lambda x: x)
    sender.start(version)
    summaries = []

    def next_message():
        m = sender.next_bucket()
        if isinstance(m, SyncSummary):
            summaries.append(m)
        return m

    assert await drive_bucketed_sync(next_message, [receiver.receive], abort=sender.abort) == version
    await engine.finish_weight_update(version)
    return summaries[0]


async def greedy(engine):
    task = PromptTask(task_id="t", prompt_id="t", step=0, policy_version=0, prompt_tokens=pack_ids(PROMPT), n=1)
    s = (await engine.generate(task)).samples[0]
    return unpack_ids(s.tokens).tolist(), torch.tensor(unpack_floats(s.logprobs).copy())


@pytest.fixture(scope="module")
def trained(tiny_dir):
    learner = make_learner(tiny_dir)
    before = {k: p.detach().clone() for k, p in learner.engine.module.named_parameters()}
    teach(learner)
    return learner, before


def test_only_adapter_parameters_train_and_are_in_the_optimizer(trained):
    learner, before = trained
    named = dict(learner.engine.module.named_parameters())
    in_optimizer = {id(p) for g in learner.torch_optimizer.param_groups for p in g["params"]}
    adapter = {n for n in named if lora.adapter_key(n) is not None}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert in_optimizer == {id(named[n]) for n in adapter}
    assert all(named[n].requires_grad == (n in adapter) for n in named)
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= adapter, sorted(changed - adapter)[:3]
    assert any(".lora_B." in n for n in changed)


async def test_sync_moves_the_adapter_alone_and_the_engine_then_computes_as_the_learner(trained, tiny_dir):
    learner, _ = trained
    engine = make_engine(tiny_dir)
    base_tokens, _ = await greedy(engine)
    summary = await sync(learner, engine, version=1)
    adapter = lora.adapter_params(learner.engine.module.model)
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapter.values())
    base_bytes = sum(p.numel() * p.element_size() for n, p in learner.engine.module.named_parameters()
                     if lora.adapter_key(n) is None)
    assert summary.num_tensors == len(adapter) and summary.nbytes == adapter_bytes
    assert summary.nbytes < base_bytes / 10
    tokens, logprobs = await greedy(engine)
    assert tokens != base_tokens  # the synced adapter, not the initial policy
    [learner_lp] = learner.logprobs([(PROMPT, tokens)])
    assert torch.allclose(logprobs, learner_lp.float(), atol=1e-5), (logprobs, learner_lp)
    assert engine.version == 1


async def test_a_sync_that_moves_no_adapter_tensor_fails_and_keeps_the_version(trained, tiny_dir):
    learner, _ = trained
    engine = make_engine(tiny_dir)
    receiver = ObjectStoreReceiver(engine.load_weights, get=lambda x: x)
    sender = ObjectStoreSender(lambda mb: iter(()), 1.0, put=lambda x: x)  # verl #7495: nothing selected
    sender.start(1)
    assert await drive_bucketed_sync(sender.next_bucket, [receiver.receive]) == 1  # the transport counts 0 == 0
    with pytest.raises(RuntimeError, match="brought 0 of the adapter's"):
        await engine.finish_weight_update(1)
    assert engine.version == 0
    # and a learner whose filter selects nothing refuses to export instead of sending an empty sync
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights_out, "wire_name", lambda engine, name, with_base=False: None)
        with pytest.raises(RuntimeError, match="no tensor"):
            list(learner.export_weights(1.0))


async def test_a_lora_warm_start_trains_the_base_which_travels_once_then_the_adapter_alone(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    learner = make_learner(tiny_dir)
    model = learner.engine.module.model
    adapter = {k: p.detach().clone() for k, p in lora.adapter_params(model).items()}
    base = {n: p.detach().clone() for n, p in learner._base_params()}
    losses = [learner.sft_step([(PROMPT, TARGET)], lr=1e-2) for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, adapter[k]) for k, p in lora.adapter_params(model).items())  # B still zero
    assert sum(not torch.equal(p, base[n]) for n, p in learner._base_params()) > len(base) // 2
    assert not learner.torch_optimizer.state  # DeepSpeed's optimizer never saw a base parameter
    engine = make_engine(tiny_dir)
    first = await sync(learner, engine, 1)  # the warm base travels (HF names) with the adapter, once
    assert first.num_tensors == len(base) + len(adapter)
    tokens, logprobs = await greedy(engine)
    [learner_lp] = learner.logprobs([(PROMPT, tokens)])
    assert torch.allclose(logprobs, learner_lp.float(), atol=1e-5)
    learner.train_step(rl_batch())
    second = await sync(learner, engine, 2)
    assert second.num_tensors == len(adapter)
    assert second.nbytes == sum(p.numel() * p.element_size() for p in lora.adapter_params(model).values())
    learner.save_base(str(tmp_path / "base"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[lora.base_hf_name(n)], p.detach()) for n, p in learner._base_params())


def test_a_lora_warm_start_is_full_fine_tunings_bit_for_bit_clipped_included(tiny_dir):
    """fp32: the base steps under an adapter equal the DeepSpeed engine's steps without one, so tiny_lora and tiny
    start RL from the same warm start. The clip binds (grad_clip far below the norm): torch's own clip differs
    from DeepSpeed's in the last bits, which fails this."""
    g = torch.Generator().manual_seed(1)
    chunks = [[(torch.randint(0, 200, (7,), generator=g).tolist(), torch.randint(0, 200, (9,), generator=g).tolist())
               for _ in range(3)] for _ in range(2)] * 3  # two chunks, three times each
    runs = []
    for lora_cfg in (LORA, LoraConfig(rank=0)):
        learner = make_learner(tiny_dir, lora_cfg=lora_cfg, grad_clip=0.05)
        losses = [learner.sft_step(c, lr=1e-2) for c in chunks]
        named = learner._base_params() if learner.lora else learner.engine.module.model.named_parameters()
        runs.append((losses, {lora.base_hf_name(n): p.detach().clone() for n, p in named}))
    (lora_losses, lora_base), (full_losses, full_base) = runs
    assert lora_losses == full_losses and lora_losses[-2] < lora_losses[0]
    assert lora_base.keys() == full_base.keys()
    assert all(torch.equal(lora_base[k], full_base[k]) for k in full_base)


def grpo_batch(seed, step):
    """A small GRPO TrainBatch of random groups (vocab of the tiny model), one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(2):
        prompt = torch.randint(0, 200, (8,), generator=g)
        comps = [torch.randint(0, 200, (6,), generator=g) for _ in range(3)]
        groups.append(TrainGroup(prompt_id=f"p{k}", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
                                 gen_logprobs=[pack_floats(torch.full((6,), -5.0)) for _ in comps],
                                 advantages=torch.randn(3, generator=g).tolist(), rewards=[0.0] * 3, policy_version=0))
    pairs = [(gi, s) for gi in range(2) for s in range(3)]
    return TrainBatch(step=step, policy_version=0, groups=groups, micro_batches=[pairs], minibatches=[[0]])


def test_checkpoint_holds_the_adapter_alone_and_resume_reproduces_the_step(tiny_dir, tmp_path):
    run = make_learner(tiny_dir, warmup_ratio=0.5)
    run.train_step(grpo_batch(1, 0))
    run.save(str(tmp_path / "ckpt"))
    states = torch.load(next((tmp_path / "ckpt" / "learner").glob("*model_states.pt")), weights_only=False)
    saved = [k.removeprefix("model.") for k, v in states["module"].items() if v.is_floating_point() and v.ndim == 2]
    # DeepSpeed drops every frozen parameter but keeps a tied one's second name (lm_head.weight, tied to
    # the embedding): the checkpoint is the adapter plus that alias, no base layer
    base = [k for k in saved if not lora.adapter_key(k)]
    assert saved and base == (["lm_head.weight"] if run.engine.module.model.config.tie_word_embeddings else []), base
    m_through = run.train_step(grpo_batch(2, 1))
    resumed = make_learner(tiny_dir, warmup_ratio=0.5)
    assert resumed.load(str(tmp_path / "ckpt")) == 1
    m_resumed = resumed.train_step(grpo_batch(2, 1))
    assert m_resumed["lr"] == m_through["lr"] and resumed.step == run.step == 2
    assert m_resumed["grad_norm"] == pytest.approx(m_through["grad_norm"], rel=1e-5)
    a, b = run.state_dict_hf(), resumed.state_dict_hf()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    fresh = make_learner(tiny_dir, warmup_ratio=0.5)  # without the checkpoint: elsewhere, so the check can fail
    fresh.train_step(grpo_batch(2, 1))
    assert not all(torch.allclose(a[k], fresh.state_dict_hf()[k], atol=1e-6) for k in a)


async def test_export_is_an_adapter_the_engine_serves_and_merges_into_a_plain_model(trained, tiny_dir, tmp_path):
    learner, _ = trained
    learner.export_hf(str(tmp_path / "hf"))
    assert lora.is_adapter_dir(tmp_path / "hf") and not (tmp_path / "hf" / "config.json").exists()
    assert read_settings(tmp_path / "hf")["max_tokens"] > 0  # eval / serve read it as an export
    served = make_engine(str(tmp_path / "hf"), lora_cfg=LoraConfig())  # no generator.lora: the export's adapter
    tokens, logprobs = await greedy(served)
    [learner_lp] = learner.logprobs([(PROMPT, tokens)])
    assert torch.allclose(logprobs, learner_lp.float(), atol=1e-5)
    merged_dir = lora.merge_export(tmp_path / "hf", tmp_path / "merged")
    assert (merged_dir / "config.json").is_file() and not lora.is_adapter_dir(merged_dir)
    merged = make_engine(str(merged_dir), lora_cfg=LoraConfig())
    m_tokens, m_logprobs = await greedy(merged)
    assert m_tokens == tokens and torch.allclose(m_logprobs, logprobs, atol=1e-4)
