"""The real Ray shells of the learner and generators (transformers engine) with the Coordinator's
sync and heal paths, and generators that Ray restarts between syncs: the nccl weight-sync
transport (gloo on CPU), and a colocated generator that comes back without an engine."""
from __future__ import annotations

import asyncio
import time

from tests.sync_actors import engine_mismatches, learner_generators_coordinator, learner_weights
from weights.nccl import Member
from weights.strategy import get_transport


def _train_and_sync(learner, coord, version: int) -> None:
    """One optimizer step (so the weights change), then the sync every step ends with."""
    import ray

    ray.get(learner.sft_step.remote([([5, 6, 7, 8, 9], [10, 11, 12])], 1e-2))
    asyncio.run(coord.weights.sync(version))
    coord.version = version


def _kill_and_wait_for_restart(g) -> dict:
    """SIGKILLs the generator's process; returns the health() of the actor Ray restarted."""
    import ray

    pid = ray.get(g.pid.remote())
    ray.kill(g, no_restart=False)
    deadline = time.monotonic() + 120
    while ray.get(g.pid.remote()) == pid:  # calls wait for (or retry on) the restarted actor
        assert time.monotonic() < deadline, "the generator was not restarted"
        time.sleep(0.2)
    return ray.get(g.health.remote())


def test_broadcast_sync_rebuilds_its_group_for_restarted_generators(tmp_path, local_ray):
    ray = local_ray
    learner, gens, coord = learner_generators_coordinator(tmp_path, "nccl", colocated=[False, False])

    def train_and_sync(version: int) -> None:
        _train_and_sync(learner, coord, version)

    def check(version: int) -> None:
        want = ray.get(learner.__ray_call__.remote(learner_weights))
        for g in gens:
            assert ray.get(g.__ray_call__.remote(engine_mismatches, want)) == []
            h = ray.get(g.health.remote())
            assert (h["version"], h["needs_weights"]) == (version, False), h

    def kill(g) -> None:
        assert _kill_and_wait_for_restart(g)["needs_weights"]  # it holds the initial weights

    train_and_sync(1)
    first = coord.weights.group
    assert first is not None and first.backend == "gloo" and first.world_size == 3
    check(1)
    train_and_sync(2)
    assert coord.weights.group == first  # a healthy group is reused, not rebuilt per sync
    check(2)

    # Restarted mid-step: WeightSync.heal resyncs it alone (through the object store, while
    # the other keeps generating); the next step's sync rebuilds the group with it.
    kill(gens[1])
    assert asyncio.run(coord.weights.heal(coord.version, timeout_s=30)) == 1
    assert ray.get(gens[1].receive_weights.remote(get_transport("nccl").call(Member()))) is None  # in no group
    check(2)
    train_and_sync(3)
    second = coord.weights.group
    assert second is not None and second != first
    check(3)

    # Restarted between steps, unnoticed until the sync: the membership check rebuilds first.
    kill(gens[0])
    train_and_sync(4)
    assert coord.weights.group not in (None, first, second)
    check(4)
    # No sync had to be redone: each restart was seen before a broadcast needed the generator.
    assert [e for e in coord.log.events if e[1] != "weight-sync group built"] == [
        ("warning", "resyncing restarted generators")]
    assert coord.log.events.count(("info", "weight-sync group built")) == 3


def test_colocated_generator_restarted_by_ray_builds_its_engine_only_when_healed_or_a_sync_is_redone(tmp_path, local_ray):
    """Colocated, the learner may be training on the GPU of a generator Ray restarts: it comes back
    with nothing built (a DeferredEngine: no weights, no KV cache) until the coordinator wakes it: in
    heal, or when a step's sync it died in is redone (the step's wake went to its predecessor)."""
    ray = local_ray
    learner, (colocated, disaggregated), coord = learner_generators_coordinator(
        tmp_path, "object_store", colocated=[True, False])
    _train_and_sync(learner, coord, 1)  # weights != the initial ones

    h = _kill_and_wait_for_restart(colocated)
    assert (h["reconstructed"], h["needs_weights"], h["engine_built"]) == (True, True, False), h
    h = _kill_and_wait_for_restart(disaggregated)  # its own GPU: rebuilt at once, as before
    assert (h["reconstructed"], h["needs_weights"], h["engine_built"]) == (True, True, True), h

    assert asyncio.run(coord.weights.heal(coord.version, timeout_s=30)) == 2
    want = ray.get(learner.__ray_call__.remote(learner_weights))
    for g in (colocated, disaggregated):
        h = ray.get(g.health.remote())
        assert (h["version"], h["needs_weights"], h["engine_built"]) == (1, False, True), h
        assert ray.get(g.__ray_call__.remote(engine_mismatches, want)) == []

    # Killed mid-step, after the step's wake(["weights"]): the redone sync wakes the new instance first
    # (without that, every attempt failed with EngineAsleep: the chaos run of 2026-12-07).
    _train_and_sync(learner, coord, 1)  # the weights move on; both generators take them
    h = _kill_and_wait_for_restart(colocated)
    assert h["engine_built"] is False, h
    asyncio.run(coord.weights.sync(2, targets=[colocated]))
    h = ray.get(colocated.health.remote())
    assert h["engine_built"] is True, h
    assert ray.get(colocated.__ray_call__.remote(engine_mismatches, ray.get(learner.__ray_call__.remote(learner_weights)))) == []
