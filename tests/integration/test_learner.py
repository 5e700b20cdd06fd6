"""The DeepSpeed learner on CPU (fp32, tiny random Qwen3): exact on-policy start, multi-epoch clipping,
gradient accumulation, ZeRO 0 == ZeRO 3, checkpoint resume, weight export."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.learner.engine import lr_lambda
from queues.messages import TrainBatch
from tests.learners import TEMPERATURE, assert_params_close, make_batch, make_learner, params, sequences

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process

@pytest.fixture(scope="module")
def learner(model_dir):
    """One ZeRO-0 learner with two update epochs, shared by the tests that only read or step it."""
    return make_learner(model_dir, update_epochs=2)


def assert_same_adam_step(a, b, lr=1e-2):
    """Parameters after one Adam step from equal gradients up to float rounding.

    Adam's first update is lr * g / (|g| + 1e-8): where |g| ~ 1e-8 a rounding-level difference in
    g moves the update by a visible share of lr. So: all but a handful of elements agree to 1e-6,
    and none is further apart than a tenth of one step.
    """
    assert a.keys() == b.keys()
    diffs = torch.cat([(a[k] - b[k]).abs().reshape(-1) for k in a])
    assert float((diffs > 1e-6).double().mean()) < 1e-3, f"{int((diffs > 1e-6).sum())} of {diffs.numel()} differ"
    assert float(diffs.max()) < 0.1 * lr


def test_logprobs_equal_an_independent_forward_at_the_sampler_temperature(learner, model_dir):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(learner.state_dict_hf(), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    seqs = sequences(make_batch(seed=7))
    got = learner.logprobs(seqs)
    with torch.no_grad():
        for (p, c), lp in zip(seqs, got):
            logits = ref(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0].double() / TEMPERATURE
            expect = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, c[:, None])[:, 0]
            assert torch.allclose(lp.double(), expect, atol=1e-5)


def test_first_epoch_is_exactly_on_policy_and_second_epoch_clips(learner):
    batch = make_batch(seed=1)
    assert len(batch.micro_batches) > 1
    m = learner.train_step(batch)
    assert all(type(v) is float for v in m.values()), {k: type(v) for k, v in m.items()}
    assert m["epoch0/ratio_mean"] == 1.0 and m["epoch0/ratio_max"] == 1.0
    assert m["epoch0/ppo_kl"] == 0.0 and m["epoch0/clipfrac"] == 0.0
    # The second epoch clips against the same old log-probs, after one optimizer step.
    assert m["epoch1/ratio_max"] > 1.2 and m["epoch1/clipfrac"] > 0.0 and m["epoch1/ppo_kl"] != 0.0
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 and m["optimizer_steps"] == 2.0
    assert m["num_loss_tokens"] == sum(len(c) // 4 for grp in batch.groups for c in grp.completions)


def test_gradient_accumulation_equals_one_micro_batch(model_dir, tmp_path):
    learner = make_learner(model_dir)
    learner.save(str(tmp_path))
    split = make_batch(seed=2, budget=40)
    whole = make_batch(seed=2, budget=10_000)
    assert len(split.micro_batches) >= 3 and len(whole.micro_batches) == 1
    m_split = learner.train_step(split)
    p_split = params(learner)
    learner.load(str(tmp_path))
    m_whole = learner.train_step(whole)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-6)
    assert m_split["pg_loss"] == pytest.approx(m_whole["pg_loss"], rel=1e-6, abs=1e-8)
    assert_same_adam_step(p_split, params(learner))


def test_one_epoch_one_minibatch_reuses_the_update_pass_log_probs_and_steps_exactly_as_a_separate_pass(model_dir, tmp_path):
    """One update epoch over one minibatch: the old log-probs are the update pass's own, detached, with no
    forward pass of their own; the step (gradients, loss, the sampler-mismatch terms, the new weights)
    equals the one with the separate no-grad pass."""
    learner = make_learner(model_dir)
    learner.save(str(tmp_path))
    batch = make_batch(seed=5, budget=40)
    assert len(batch.micro_batches) >= 3 and len(batch.minibatches) == 1
    m_reused = learner.train_step(batch)
    p_reused = params(learner)
    assert m_reused["old_logprobs_reused"] == 1.0 and m_reused["ratio_max"] == 1.0
    learner.load(str(tmp_path))
    learner._reuses_old_logprobs = lambda n: False  # the separate pass, as with two epochs or minibatches
    m_pass = learner.train_step(batch)
    assert m_pass["old_logprobs_reused"] == 0.0 and m_pass["old_logprob_s"] > 0.0
    assert m_reused["grad_norm"] == pytest.approx(m_pass["grad_norm"], rel=1e-6)
    assert m_reused["pg_loss"] == pytest.approx(m_pass["pg_loss"], rel=1e-6, abs=1e-8)
    assert m_reused["mismatch_kl"] == pytest.approx(m_pass["mismatch_kl"], rel=1e-6)
    assert_same_adam_step(p_reused, params(learner))
    two = make_learner(model_dir, update_epochs=2)
    assert two.train_step(make_batch(seed=5, budget=40))["old_logprobs_reused"] == 0.0


def test_zero3_matches_zero0_and_exports_full_weights(model_dir):
    batch = make_batch(seed=3, minibatches=2)
    z0 = make_learner(model_dir, zero_stage=0)
    z3 = make_learner(model_dir, zero_stage=3)
    m0, m3 = z0.train_step(batch), z3.train_step(batch)
    assert m3["ppo_kl"] == pytest.approx(m0["ppo_kl"], abs=1e-6)
    assert m3["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    p0 = params(z0)
    buckets = list(z3.export_weights(bucket_mb=0.01))  # 10 KiB: many buckets
    assert len(buckets) > 1
    p3 = {n: t for b in buckets for n, t in b}
    assert sum(len(b) for b in buckets) == len(p3)  # every name once
    assert {k: v.shape for k, v in p3.items()} == {k: v.shape for k, v in p0.items()}
    assert_same_adam_step(p0, p3)


def test_save_load_resume_reproduces_the_uninterrupted_step(model_dir, tmp_path):
    b1, b2 = make_batch(seed=4, step=0), make_batch(seed=5, step=1)
    run = make_learner(model_dir, warmup_ratio=0.5, total_steps=4)
    run.train_step(b1)
    run.save(str(tmp_path / "ckpt"))
    m_through = run.train_step(b2)
    resumed = make_learner(model_dir, warmup_ratio=0.5, total_steps=4)
    assert resumed.load(str(tmp_path / "ckpt")) == 1
    m_resumed = resumed.train_step(b2)
    assert m_resumed["lr"] == m_through["lr"] and resumed.step == run.step == 2
    assert m_resumed["grad_norm"] == pytest.approx(m_through["grad_norm"], rel=1e-6)
    assert_params_close(params(run), params(resumed), atol=1e-6)
    # Without the checkpoint the same step lands elsewhere: the comparison above can fail.
    fresh = make_learner(model_dir, warmup_ratio=0.5, total_steps=4)
    fresh.train_step(b2)
    with pytest.raises(AssertionError):
        assert_params_close(params(run), params(fresh), atol=1e-6)


def test_sft_step_lowers_cross_entropy_on_its_targets(model_dir):
    learner = make_learner(model_dir)
    pairs = [([1, 2, 3, 4], [5, 6, 7]), ([9, 8], [7, 6, 5, 4])]
    losses = [learner.sft_step(pairs) for _ in range(5)]
    assert all(type(x) is float for x in losses)
    assert losses[-1] < losses[0] - 0.1


def test_export_hf_serves_the_trained_weights(learner, tmp_path):
    learner.train_step(make_batch(seed=6))
    learner.export_hf(str(tmp_path / "hf"))
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    seqs = sequences(make_batch(seed=8))[:3]
    with torch.no_grad():
        for (p, c), lp in zip(seqs, learner.logprobs(seqs)):
            logits = served(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0] / TEMPERATURE
            expect = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, c[:, None])[:, 0]
            assert torch.allclose(lp, expect, atol=1e-5)


def test_malformed_batches_are_refused_by_name(learner):
    batch = make_batch(seed=9)
    dup = TrainBatch(step=0, policy_version=0, groups=batch.groups,
                     micro_batches=[batch.micro_batches[0], batch.micro_batches[0][:1]], minibatches=[[0, 1]])
    with pytest.raises(ValueError, match="appears twice"):
        learner.train_step(dup)
    missing = TrainBatch(step=0, policy_version=0, groups=batch.groups, micro_batches=batch.micro_batches,
                         minibatches=[[0]])
    with pytest.raises(ValueError, match="every micro-batch exactly once"):
        learner.train_step(missing)


def test_lr_schedule_warms_up_then_decays():
    f = lr_lambda("cosine", warmup_steps=2, total_steps=6)
    assert [round(f(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, 0.0]
    assert lr_lambda("linear", 0, 4)(2) == 0.5 and lr_lambda("constant", 0, 4)(3) == 1.0


def test_kl_entropy_and_truncated_importance_terms_run_through_the_learner(model_dir):
    learner = make_learner(model_dir, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, update_epochs=2)
    m = learner.train_step(make_batch(seed=10, gen_logprob=-30.0))
    # The reference model is the starting policy: the first epoch's KL to it is exactly zero.
    assert m["epoch0/ppo_kl"] == 0.0 and m["kl"] > 0.0  # the second epoch has moved away
    assert 0.0 < m["entropy"] <= math.log(256)
    # The sampler's log-probs (-30) are far below the policy's (~ -6): every weight hits the cap.
    assert m["tis_weight_mean"] == 2.0 and m["tis_capped_frac"] == 1.0


def _inv_freqs(model):
    return {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}


def test_rotary_inv_freq_is_restored_to_fp32_after_a_zero_init_style_cast(model_dir, monkeypatch):
    """zero.Init (ZeRO-3 with HfDeepSpeedConfig on a GPU) turns inv_freq into bf16; the learner must undo it."""
    import transformers

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = _inv_freqs(plain)
    assert want and all(b.dtype == torch.float32 for b in want.values())
    clean = make_learner(model_dir, zero_stage=3)
    orig = transformers.AutoModelForCausalLM.from_pretrained

    def corrupting(*a, **k):
        m = orig(*a, **k)
        for mod in m.modules():
            for name in list(mod._buffers):
                if name.endswith("inv_freq") and mod._buffers[name] is not None:
                    mod._buffers[name] = mod._buffers[name].to(torch.bfloat16)
        return m

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", corrupting)
    fixed = make_learner(model_dir, zero_stage=3)
    got = _inv_freqs(fixed.engine.module.model)
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == torch.float32 and torch.equal(got[n], want[n]), n
    # A long sequence: a bf16 inv_freq moves these log-probs by ~1e-2 here (checked below).
    g = torch.Generator().manual_seed(11)
    seqs = [(torch.randint(0, 256, (700,), generator=g), torch.randint(0, 256, (100,), generator=g))]
    ref = clean.logprobs(seqs)[0]
    assert torch.equal(fixed.logprobs(seqs)[0], ref)
    rot = fixed.engine.module.model.model.rotary_emb
    rot.inv_freq = rot.inv_freq.to(torch.bfloat16)
    assert float((fixed.logprobs(seqs)[0] - ref).abs().max()) > 1e-3  # the test can see the bug


def _optimizer_tensors(learner):
    opt = learner.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    # ZeRO-3 keeps its fp32 masters outside the inner optimizer's param_groups between steps.
    masters = [p for g in inner.param_groups for p in g["params"]] + list(getattr(opt, "fp32_partitioned_groups_flat", []))
    return out + [p.detach() for p in masters]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_sleep_with_offload_then_wake_trains_exactly_as_without_sleep(model_dir, zero_stage):
    b1, b2 = make_batch(seed=12), make_batch(seed=13, step=1)
    runs = []
    for sleep in (False, True):
        learner = make_learner(model_dir, zero_stage=zero_stage, offload_optimizer=True)
        learner.train_step(b1)
        before = [t.clone() for t in _optimizer_tensors(learner)]
        if sleep:
            learner.sleep()
            assert learner.asleep
            learner.wake()
            after = _optimizer_tensors(learner)
            assert len(after) == len(before)
            assert all(torch.equal(a, b) for a, b in zip(after, before))
        runs.append((learner.train_step(b2), params(learner)))
    (m0, p0), (m1, p1) = runs
    assert m1["grad_norm"] == m0["grad_norm"]
    assert_params_close(p0, p1, atol=0.0)


def test_sleep_offload_really_moves_the_state_of_the_unwrapped_optimizer(model_dir):
    learner = make_learner(model_dir, offload_optimizer=True)
    learner.train_step(make_batch(seed=14))
    state = next(iter(learner.torch_optimizer.state.values()))
    ptr, val = state["exp_avg"].data_ptr(), state["exp_avg"].clone()
    learner.sleep()
    assert learner._offloaded is not None and state["exp_avg"].data_ptr() != ptr  # copied out
    learner.train_step(make_batch(seed=15))  # wakes first
    assert not learner.asleep and learner._offloaded is None
    assert not torch.equal(state["exp_avg"], val)  # the step used (and updated) the restored state


@pytest.mark.parametrize("zero_stage,dtype", [(0, "bfloat16"), (3, "float32"), (3, "bfloat16")])
def test_sleep_offload_frees_every_fp32_master_and_adam_storage(model_dir, zero_stage, dtype):
    """After sleep() no storage of an fp32 master or Adam state survives (checked through weak storage
    refs, so neither another view nor a list inside DeepSpeed keeps one alive); ZeRO-3 holds its
    masters only in `fp32_partitioned_groups_flat`, outside the inner optimizer's param_groups."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    learner = make_learner(model_dir, zero_stage=zero_stage, dtype=dtype, offload_optimizer=True)
    learner.train_step(make_batch(seed=16))
    model_params = list(learner.engine.module.parameters())
    weights = {t.untyped_storage().data_ptr() for p in model_params for t in (p, getattr(p, "ds_tensor", p))}
    tensors = [t for t in _optimizer_tensors(learner) if t.untyped_storage().data_ptr() not in weights]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model_params)
    fp32 = sum(t.numel() for t in tensors if t.dtype == torch.float32)
    assert fp32 >= 3 * numel  # masters + exp_avg + exp_avg_sq are all tracked
    refs = [(StorageWeakRef(t.untyped_storage()), (tuple(t.shape), str(t.dtype))) for t in tensors]
    del tensors
    learner.sleep()
    gc.collect()
    assert [what for r, what in refs if not r.expired()] == []  # still on the device after sleep
    learner.train_step(make_batch(seed=17))  # wakes first, then steps on the restored state
    assert not learner.asleep and learner._offloaded is None


def test_checkpoint_layers_keeps_activations_of_the_other_layers_and_trains_identically(model_dir):
    """learner.checkpoint_layers=N: the first N decoder layers keep only their input for backward
    (they recompute the rest), the others keep every activation; the update is bit-identical to
    checkpointing every layer and to none. Measured as the bytes autograd saves outside
    checkpointed regions during one train step."""
    runs = {}
    for gc, n in ((False, -1), (True, -1), (True, 1), (True, 0)):
        learner = make_learner(model_dir, gradient_checkpointing=gc, checkpoint_layers=n)
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            learner.train_step(make_batch(seed=21))
        runs[(gc, n)] = (learner.checkpointed_layers, saved[0], params(learner))
    assert [v[0] for v in runs.values()] == [0, 2, 1, 0]
    none, every, first, zero = (runs[k][1] for k in runs)
    assert zero == none > first > every and none - first == first - every, (none, first, every)
    for key in runs:
        assert_params_close(runs[(False, -1)][2], runs[key][2], atol=0.0)
    with pytest.raises(ValueError, match="checkpoint_layers=3: the model has 2 decoder layers"):
        make_learner(model_dir, gradient_checkpointing=True, checkpoint_layers=3)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_checkpoint_written_while_asleep_resumes_exactly_and_lr_is_the_step_s_own(model_dir, tmp_path, zero_stage):
    """The coordinator checkpoints after learner.sleep(), with the optimizer offloaded: the checkpoint
    must hold the real optimizer state (resume == uninterrupted). The logged lr is the rate the step
    used (warm-up: half of lr at step 0), not the next step's."""
    b1, b2 = make_batch(seed=4, step=0), make_batch(seed=5, step=1)
    kw = dict(warmup_ratio=0.5, total_steps=4, zero_stage=zero_stage, offload_optimizer=True)
    run = make_learner(model_dir, **kw)
    m1 = run.train_step(b1)
    assert m1["lr"] == pytest.approx(0.5e-2)  # lr_lambda(step 0) = 1/2 of 1e-2 during the 2 warm-up steps
    run.sleep()
    run.save(str(tmp_path / "ckpt"))
    assert run.asleep  # saving does not change the learner's phase
    m_through = run.train_step(b2)
    assert m_through["lr"] == pytest.approx(1e-2)
    resumed = make_learner(model_dir, **kw)
    assert resumed.load(str(tmp_path / "ckpt")) == 1
    m_resumed = resumed.train_step(b2)
    assert m_resumed["grad_norm"] == pytest.approx(m_through["grad_norm"], rel=1e-6)
    assert_params_close(params(run), params(resumed), atol=1e-6)
    # The launcher's order on a shared GPU: built, put to sleep, then resumed from the checkpoint.
    asleep = make_learner(model_dir, **kw)
    asleep.sleep()
    assert asleep.load(str(tmp_path / "ckpt")) == 1 and asleep.asleep
    m_asleep = asleep.train_step(b2)
    assert m_asleep["grad_norm"] == pytest.approx(m_through["grad_norm"], rel=1e-6)
    assert_params_close(params(run), params(asleep), atol=1e-6)


async def test_a_batch_delivered_while_waiting_but_never_seen_is_found_in_pending(redis_url):
    """A reply lost on a reconnect leaves the step's batch delivered to learner-0 (pending) but never
    returned to it: the shell re-reads its pending list while it waits (it read it only at call start,
    then waited out the 600 s timeout). A missing batch times out naming the step and the stream."""
    import asyncio

    from actors.learner.shell import LearnerShell
    from config import RunContext
    from queues.messages import codec
    from queues.streams import Stream, connect
    from queues.topology import BATCHES

    shell = LearnerShell.__new__(LearnerShell)  # the stream side only: no model is built
    shell.trained_steps = set()
    shell.ctx = RunContext(run_id="lost", redis_url=redis_url)
    await shell.connect()
    real_consume, lost = shell.batches.consume, []

    async def consume_losing_the_first_reply(*args, **kwargs):
        got = await real_consume(*args, **kwargs)
        if got and not lost:  # Redis delivered it to learner-0; the reply never reached the shell
            lost.extend(got)
            return []
        return got

    shell.batches.consume = consume_losing_the_first_reply
    waiting = asyncio.create_task(shell._take(0, timeout_s=20.0))
    await asyncio.sleep(0.3)  # the shell is waiting on the stream now
    other = Stream(await connect(redis_url), "lost", BATCHES)
    await other.publish(codec(TrainBatch).encode(make_batch(step=0)))
    msg_id, batch, _ = await asyncio.wait_for(waiting, 15.0)
    assert len(lost) == 1 and msg_id == lost[0][0] and batch.step == 0
    with pytest.raises(TimeoutError, match=r"step 1 on stream arl:lost:batches"):
        await shell._take(1, timeout_s=1.0)
