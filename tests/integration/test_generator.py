"""Generator over a real redis-server and a real tiny transformers model: streaming, one group
per task, acks after publish, error groups, pause/resume, reclaim, version stamps."""
import asyncio
import time

import pytest
import torch

from actors.engines.base import DeferredEngine, EngineAsleep
from actors.engines.hf import TransformersEngine
from actors.engines.simulated import SimulatedEngine
from actors.generator.generator import Generator
from config import GeneratorConfig, ModelConfig
from queues.messages import PromptTask, codec, pack_ids
from tests.rollout_streams import RUN, collect, streams

torch.set_num_threads(1)

MODEL_CFG = ModelConfig(source="tiny", dtype="float32")
GEN_CFG = GeneratorConfig(engine="transformers", device="cpu", max_tokens=8, max_inflight_prompts=16,
                          max_batch_prompts=16)


@pytest.fixture
def engine(tiny_dir):
    return TransformersEngine(GEN_CFG, MODEL_CFG, tiny_dir)


def task(engine, i, text="SELECT name FROM singer", n=2, **sampling):
    ids = engine.tokenizer(text)["input_ids"] if text else []
    return PromptTask(task_id=f"0:{i}:0", prompt_id=f"q{i}", step=0, policy_version=0, prompt_tokens=pack_ids(ids),
                      n=n, sampling=sampling, published_at=time.time())


async def stop(gen, runner):
    gen.stop()
    await asyncio.wait_for(runner, 20)


async def test_each_group_is_streamed_as_it_finishes_and_every_task_yields_one(redis_url, engine):
    prompts, rollouts = await streams(redis_url)
    gen = Generator(engine, GEN_CFG)
    lengths = [2, 2, 250, 250, 3, 4]
    for i, m in enumerate(lengths):
        await prompts.publish(codec(PromptTask).encode(task(engine, i, max_tokens=m, temperature=0)))
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen0"))
    got = await collect(rollouts, len(lengths))
    await stop(gen, runner)
    by_task = {g.task.task_id: (arrived, g) for arrived, g in got}
    assert sorted(by_task) == sorted(f"0:{i}:0" for i in range(len(lengths))) and len(got) == len(lengths)
    first_arrival = min(a for a, _ in got)
    last_finish = max(g.finished_at for _, g in got)
    long_gen = max(g.finished_at - g.started_at for _, g in got)
    assert last_finish - first_arrival > 0.5 * long_gen, "the first group was not published while the long ones ran"
    for arrived, g in got:
        assert not g.error and len(g.samples) == 2 and g.generator_id == "gen0"
        assert g.queued_at <= g.started_at <= g.finished_at <= g.published_at <= arrived
    assert (await prompts.depth())["pending"] == 0, "every task is acked once published"
    assert gen.stats()["generator_groups_published"] == len(lengths)


async def test_malformed_tasks_get_error_groups_and_the_generator_keeps_serving(redis_url, engine):
    prompts, rollouts = await streams(redis_url)
    gen = Generator(engine, GEN_CFG)
    bad = {
        "0:0:0": codec(PromptTask).encode(task(engine, 0, text="")),
        "0:1:0": codec(PromptTask).encode(PromptTask(task_id="0:1:0", prompt_id="q1", step=0, policy_version=0,
                                                     prompt_tokens=pack_ids([5] * (engine.max_model_len + 3)), n=2)),
        "0:2:0": codec(PromptTask).encode(task(engine, 2, n=0)),
        "": b"\x93not a prompt task",
    }
    for data in bad.values():
        await prompts.publish(data)
    await prompts.publish(codec(PromptTask).encode(task(engine, 9)))
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen0"))
    got = {g.task.task_id: g for _, g in await collect(rollouts, 5)}
    assert not runner.done()
    await prompts.publish(codec(PromptTask).encode(task(engine, 10)))  # still serving afterwards
    got.update({g.task.task_id: g for _, g in await collect(rollouts, 1)})
    await stop(gen, runner)
    expect = {"0:0:0": "empty", "0:1:0": "max_position_embeddings", "0:2:0": "n must be", "": "cannot decode"}
    for tid, words in expect.items():
        assert words in got[tid].error and "\n" not in got[tid].error and got[tid].samples == []
    for tid in ("0:9:0", "0:10:0"):
        assert got[tid].error == "" and len(got[tid].samples) == 2
    assert gen.stats()["generator_error_groups"] == 4
    assert (await prompts.depth())["pending"] == 0


async def test_pause_returns_after_in_flight_groups_are_published_and_stops_pulling(redis_url, engine):
    prompts, rollouts = await streams(redis_url)
    gen = Generator(engine, GEN_CFG)
    for i in range(4):
        await prompts.publish(codec(PromptTask).encode(task(engine, i, max_tokens=60)))
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen0"))
    while gen.stats()["generator_inflight_prompts"] == 0:
        await asyncio.sleep(0.005)
    await gen.pause()
    assert gen.stats()["generator_inflight_prompts"] == 0
    published = gen.stats()["generator_groups_published"]
    assert published >= 1 and (await prompts.depth())["pending"] == 0
    assert await rollouts.backlog() == published
    for i in range(4, 7):
        await prompts.publish(codec(PromptTask).encode(task(engine, i, max_tokens=4)))
    await asyncio.sleep(0.4)
    assert gen.stats()["generator_groups_published"] == published, "a paused generator pulled a task"
    gen.resume()
    got = await collect(rollouts, 7)
    await stop(gen, runner)
    assert sorted(g.task.task_id for _, g in got) == sorted(f"0:{i}:0" for i in range(7))


async def test_tasks_left_pending_by_a_dead_generator_are_reclaimed(redis_url, engine):
    prompts, rollouts = await streams(redis_url)
    for i in range(3):
        await prompts.publish(codec(PromptTask).encode(task(engine, i)))
    taken = await prompts.consume("dead-gen", count=3, block_ms=100)  # pulled, then the consumer "dies"
    assert len(taken) == 3
    gen = Generator(engine, GEN_CFG, reclaim_idle_s=0.2)
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen1"))
    got = await collect(rollouts, 3)
    await stop(gen, runner)
    assert sorted(g.task.task_id for _, g in got) == ["0:0:0", "0:1:0", "0:2:0"]
    assert gen.stats()["generator_tasks_reclaimed"] == 3
    assert (await prompts.depth())["pending"] == 0


async def test_a_slow_task_is_not_stolen_from_a_live_generator(redis_url, engine, monkeypatch):
    """The heartbeat keeps a long in-flight task fresh, so a peer never reclaims (duplicates) it.

    The task is held in flight (its group waits at a gate after generation) until the peer has scanned
    for idle entries three times after the entry would have been idle past reclaim_idle_s without a
    heartbeat: the count of the peer's scans, not a clock, decides that stealing had its chances.
    reclaim_idle_s=3: a heartbeat (every 1 s) late by 2 s on a loaded machine still keeps the entry."""
    from queues.streams import Stream as StreamClass

    idle_s = 3.0
    prompts, rollouts = await streams(redis_url)
    await prompts.publish(codec(PromptTask).encode(task(engine, 0, n=4, max_tokens=8, temperature=0)))
    scans_after: list[float] = []  # the peer's reclaim scans, once the entry could have been stolen
    stealable_from: list[float] = []
    gate = asyncio.Event()
    reclaim = StreamClass.reclaim

    async def counted_reclaim(self, consumer, min_idle_ms, count=16):
        got = await reclaim(self, consumer, min_idle_ms, count)
        if consumer == "peer" and stealable_from and time.monotonic() > stealable_from[0]:
            scans_after.append(time.monotonic())
            if len(scans_after) >= 3:
                gate.set()
        return got

    monkeypatch.setattr(StreamClass, "reclaim", counted_reclaim)
    generate = engine.generate

    async def held(t):
        stealable_from.append(time.monotonic() + idle_s)
        group = await generate(t)
        await asyncio.wait_for(gate.wait(), 120)  # the peer's third scan past the idle bound
        return group

    engine.generate = held
    worker = Generator(engine, GEN_CFG, reclaim_idle_s=idle_s)
    w = asyncio.create_task(worker.run(redis_url, RUN, "worker"))
    while worker.stats()["generator_inflight_prompts"] == 0:
        await asyncio.sleep(0.005)
    peer = Generator(TransformersEngine(GEN_CFG, MODEL_CFG, engine.model.name_or_path), GEN_CFG, reclaim_idle_s=idle_s)
    p = asyncio.create_task(peer.run(redis_url, RUN, "peer"))
    got = await collect(rollouts, 1, timeout=150)
    await stop(worker, w)
    await stop(peer, p)
    assert got[0][1].generator_id == "worker" and len(scans_after) >= 3
    assert peer.stats()["generator_tasks_reclaimed"] == 0
    assert (await rollouts.depth())["lag"] == 0, "a duplicate group was published"


async def test_groups_carry_the_policy_version_that_produced_them(redis_url, engine):
    prompts, rollouts = await streams(redis_url)
    gen = Generator(engine, GEN_CFG)
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen0"))
    await prompts.publish(codec(PromptTask).encode(task(engine, 0)))
    (_, first), = await collect(rollouts, 1)
    await gen.sleep(2)
    await gen.wake(["weights"])
    await gen.load_weights(list(engine.model.state_dict().items()), 1)  # (a copy of itself)
    await gen.finish_weight_update(1)
    await gen.wake(["kv_cache"])
    gen.resume()
    await prompts.publish(codec(PromptTask).encode(task(engine, 1)))
    (_, second), = await collect(rollouts, 1)
    gen.set_version(5)
    await prompts.publish(codec(PromptTask).encode(task(engine, 2)))
    (_, third), = await collect(rollouts, 1)
    await stop(gen, runner)
    assert (first.policy_version, second.policy_version, third.policy_version) == (0, 1, 5)


async def test_deferred_engine_is_built_once_on_the_first_wake_and_keeps_the_version():
    builds = []

    def build():
        builds.append(1)
        return SimulatedEngine(GeneratorConfig(engine="simulated", max_tokens=8), mean_response_tokens=4,
                               tick_s=0.0, per_seq_s=0.0)

    engine = DeferredEngine(build)
    task = PromptTask(task_id="0", prompt_id="0", step=0, policy_version=0, prompt_tokens=pack_ids([1, 2]), n=2)
    with pytest.raises(EngineAsleep):
        await engine.generate(task)
    with pytest.raises(EngineAsleep):
        await engine.load_weights([], 3)
    await engine.sleep(1)  # a no-op: nothing to release
    engine.abort()
    engine.version = 7
    assert (builds, engine.built, engine.stats()) == ([], False, {"engine_built": 0.0})
    await asyncio.gather(engine.wake(["weights"]), engine.wake(["weights"]))
    assert (len(builds), engine.built, engine.version) == (1, True, 7)
    group = await engine.generate(task)
    assert len(group.samples) == 2 and group.policy_version == 7
    engine.version = 8
    assert engine.engine.version == 8 and engine.stats()["engine_built"] == 1.0


def test_device_ids_become_cuda_visible_devices_and_bad_ones_are_named():
    from types import SimpleNamespace

    from actors.engines.base import set_visible_devices

    env: dict[str, str] = {}
    assert set_visible_devices([3, 1], SimpleNamespace(tensor_parallel_size=2), env) == "3,1"
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"  # the placement's order: TP rank 0 on GPU 3
    for bad, match in (([], "non-empty list"), ([0, 0], "lists a GPU twice"), ([-1], "non-negative"),
                       ([True], "non-negative"), ("0", "non-empty list")):
        with pytest.raises(ValueError, match=f"device_ids.*{match}|{match}"):
            set_visible_devices(bad, None, {})
    with pytest.raises(ValueError, match="has 1 GPU\\(s\\), generator.tensor_parallel_size is 2"):
        set_visible_devices([0], SimpleNamespace(tensor_parallel_size=2), {})


async def test_a_pause_that_outlasts_its_timeout_aborts_and_publishes_failed_groups(redis_url, engine):
    """A request that would run far longer than generator.pause_timeout_s must not hang the step: the
    pause aborts it after the timeout and its group is published as failed (error set)."""
    import msgspec

    cfg = msgspec.structs.replace(GEN_CFG, max_tokens=100_000, pause_timeout_s=0.5)
    engine.eos_ids = set()  # the random-init model may sample eos: these requests end only by the abort
    prompts, rollouts = await streams(redis_url)
    gen = Generator(engine, cfg)
    await prompts.publish(codec(PromptTask).encode(task(engine, 0, max_tokens=100_000)))
    runner = asyncio.create_task(gen.run(redis_url, RUN, "gen0"))
    while gen.stats()["generator_inflight_prompts"] == 0:
        await asyncio.sleep(0.005)
    t0 = time.monotonic()
    await asyncio.wait_for(gen.pause(), 20)
    assert 0.4 < time.monotonic() - t0 < 15
    [(_, group)] = await collect(rollouts, 1)
    assert group.error and "aborted" in group.error
    assert gen.stats()["generator_pause_timeouts"] == 1
    gen.resume()
    await stop(gen, runner)
