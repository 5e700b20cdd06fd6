"""Partial rollouts across a weight update: a real tiny transformers model, a real redis-server, the
real Generator and the assembler's admission. Interrupted samples carry two versions, their
log-probs stay aligned with their tokens (teacher-forced under the weights of each version), nothing
is lost or doubled, and admission counts the oldest version."""
import asyncio
import copy
import time

import pytest
import torch

from actors.assembler import STALE, TRAINED, admit
from actors.engines.hf import TransformersEngine
from actors.engines.simulated import SimulatedEngine
from actors.generator.generator import Generator
from config import AssemblerConfig, GeneratorConfig, ModelConfig
from queues.messages import (
    PromptTask,
    RolloutGroup,
    ScoredGroup,
    codec,
    oldest_version,
    pack_ids,
    sample_versions,
    unpack_floats,
    unpack_ids,
)
from queues.streams import Stream, connect
from queues.topology import PROMPTS, ROLLOUTS

torch.set_num_threads(1)

MODEL_CFG = ModelConfig(source="tiny", dtype="float32")
GEN_CFG = GeneratorConfig(engine="transformers", device="cpu", max_tokens=48, max_inflight_prompts=8)
RUN = "partial-test"


def _task(engine, i, n=2):
    ids = engine.tokenizer("SELECT name FROM singer WHERE")["input_ids"]
    return PromptTask(task_id=f"0:{i}:0", prompt_id=f"q{i}", step=0, policy_version=0, prompt_tokens=pack_ids(ids), n=n,
                      published_at=time.time())


async def _until(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.001)


@torch.no_grad()
def _teacher_forced(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(tokens)]


async def test_a_rollout_interrupted_by_a_weight_update_continues_under_the_new_weights(tiny_dir, redis_url):
    engine = TransformersEngine(GEN_CFG, MODEL_CFG, tiny_dir)
    engine.eos_ids = set()  # an untrained model may end a row at once; this test needs long rows
    gen = Generator(engine, GEN_CFG, consume_block_ms=20)
    redis = await connect(redis_url)
    prompts = Stream(redis, RUN, PROMPTS)
    rollouts = Stream(redis, RUN, ROLLOUTS)
    await prompts.ensure_group()
    await rollouts.ensure_group()
    tasks = [_task(engine, i) for i in range(3)]
    await prompts.publish_many([codec(PromptTask).encode(t) for t in tasks])
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen-0"))
    try:
        await _until(lambda: any(len(r.tokens) >= 3 for q in engine._active for r in q.rows), 60, "no row decoding")
        # Hold the next decode step until the interrupt is asked for, so no row can run to max_tokens in between
        # (CI's busy cores once let all of them end before the pause's read of the prompts stream had returned).
        lock = engine._model_lock()
        await lock.acquire()
        pausing = asyncio.create_task(gen.pause(interrupt=True))
        try:
            await _until(lambda: engine._interrupting, 30, "the pause never asked the engine to interrupt")
        finally:
            lock.release()
        await asyncio.wait_for(pausing, 60)
        assert len(gen._inflight) == 3  # nothing finished or published at the boundary
        parked = {q.task.task_id: [(list(r.tokens), list(r.logprobs)) for r in q.rows] for q in engine._parked}
        assert parked and all(len(r[0]) >= 1 for rows in parked.values() for r in rows)
        assert engine.stats()["engine_parked_requests"] == len(parked)
        old_model = copy.deepcopy(engine.model)
        g = torch.Generator().manual_seed(1)
        new = [(n, p.detach() + 0.5 * torch.randn(p.shape, generator=g)) for n, p in engine.model.named_parameters()]
        await engine.load_weights(new, 1)
        await engine.finish_weight_update(1)
        gen.resume()
        groups = []
        deadline = time.monotonic() + 60
        while len(groups) < 3:
            assert time.monotonic() < deadline, f"{len(groups)} of 3 groups"
            for eid, data in await rollouts.consume("s0", count=8, block_ms=50):
                groups.append(codec(RolloutGroup).decode(data))
                await rollouts.ack([eid])
    finally:
        gen.stop()
        await asyncio.wait_for(runner, 30)
    assert sorted(x.task.task_id for x in groups) == sorted(t.task_id for t in tasks)  # none lost, none doubled
    assert gen.stats()["generator_interrupted_requests"] == len(parked)
    spanning = 0
    for group in groups:
        # A parked group started at version 0; one the engine had not started yet runs wholly at 1.
        assert group.policy_version == oldest_version(group) == (0 if group.task.task_id in parked else group.policy_version)
        for si, s in enumerate(group.samples):
            tokens, lps = unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()
            versions = sample_versions(s, group.policy_version).tolist()
            assert len(tokens) == len(lps) == len(versions) == GEN_CFG.max_tokens
            assert versions == sorted(versions) and set(versions) <= {0, 1} and versions[0] == group.policy_version
            if group.task.task_id in parked:
                before_t, before_lp = parked[group.task.task_id][si]
                assert tokens[:len(before_t)] == before_t and lps[:len(before_lp)] == before_lp  # kept as they were
                assert versions.count(0) == len(before_t)  # the switch falls exactly at the interruption
            spanning += set(versions) == {0, 1}
            prompt = unpack_ids(group.task.prompt_tokens).tolist()
            want_old, want_new = _teacher_forced(old_model, prompt, tokens), _teacher_forced(engine.model, prompt, tokens)
            want = [o if v == 0 else n for o, n, v in zip(want_old, want_new, versions)]
            assert lps == pytest.approx(want, abs=2e-4)  # each token's log-prob is its own version's
    assert spanning >= 1
    scored = ScoredGroup(rollout=next(x for x in groups if x.task.task_id in parked), rewards=[1.0, 0.0],
                         verdicts=["match", "wrong_result"])
    assert admit(scored, 1, AssemblerConfig(max_staleness=1)) == TRAINED
    assert admit(scored, 1, AssemblerConfig(max_staleness=0)) == STALE  # its oldest token is version 0
    await redis.aclose()


async def test_simulated_engine_parks_and_continues_groups_with_per_tick_versions():
    cfg = GeneratorConfig(engine="simulated", max_tokens=200)
    engine = SimulatedEngine(cfg, mean_response_tokens=60, sigma=0.01, tick_s=0.002, seed=3)
    task = PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids([1, 2]), n=3)
    running = asyncio.create_task(engine.generate(task))
    await _until(lambda: engine._live > 0, 10, "never started")
    await asyncio.sleep(0.03)
    assert await engine.interrupt() == 1
    await asyncio.sleep(0.05)
    assert not running.done()  # parked, not finished
    engine.version = 1
    assert engine.continue_interrupted() == 1
    group = await asyncio.wait_for(running, 10)
    assert group.policy_version == 0 and len(group.samples) == 3
    for s in group.samples:
        v = sample_versions(s, 0).tolist()
        assert len(v) == len(s.tokens) // 4 and v[0] == 0 and v[-1] == 1 and v == sorted(v)


async def test_stop_while_requests_are_parked_finishes_them_instead_of_hanging(redis_url):
    cfg = GeneratorConfig(engine="simulated", max_tokens=400, max_inflight_prompts=4)
    engine = SimulatedEngine(cfg, mean_response_tokens=200, sigma=0.01, tick_s=0.002, seed=1)
    gen = Generator(engine, cfg, consume_block_ms=20)
    redis = await connect(redis_url)
    prompts = Stream(redis, RUN, PROMPTS)
    await prompts.ensure_group()
    task = PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids([1, 2]), n=2)
    await prompts.publish(codec(PromptTask).encode(task))
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen-0"))
    await _until(lambda: engine._live > 0, 30, "never started")
    assert await gen.pause(interrupt=True) == 1
    gen.stop()
    await asyncio.wait_for(runner, 30)  # the parked group finished and was published
    assert gen.stats()["generator_groups_published"] == 1.0
    await redis.aclose()
