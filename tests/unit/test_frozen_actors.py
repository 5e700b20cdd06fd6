"""Every wait on an actor has a bound: a frozen actor (alive to Ray, silent) ends the wait with one line
naming the actor and the call (ActorCallTimeout), which the launcher handles as a death.

The first tests drive the bound with plain objects standing in for actors that never answer (fake:
an awaitable that never completes); the last ones SIGSTOP a real learner rank of a 2-rank group on a
real local Ray (and a whole tiny run whose SIGSTOPped generator is restarted in place).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.handles import GROUP_SLACK_S, AssemblerHandle, CallBounds, GeneratorPool, LearnerHandle, bounded
from actors.shell import ActorCallTimeout
from config import RunContext, apply_overrides
from config.recipes import get_recipe


def _cfg(*overrides: str):
    return apply_overrides(get_recipe("tiny"), ["coordinator.call_timeout_s=0.5", "generator.pause_timeout_s=0.25",
                                                "coordinator.step_timeout_s=2", *overrides])


def test_a_call_is_bounded_by_call_timeout_s_on_top_of_its_own_wait():
    bounds = CallBounds.of(_cfg())
    generators, assembler, learner = GeneratorPool([], bounds), AssemblerHandle(None, bounds), LearnerHandle(None, bounds)
    assert generators.control_s == 0.5  # wake
    assert generators.pause_s == 0.75  # sleep, pause
    assert assembler.collect_s == 2.5  # collect, peek
    assert assembler.control_s == 0.5  # forget_before
    assert learner.control_s == 0.5 + GROUP_SLACK_S  # sleep: the group's own line comes first
    assert learner.step_s == 2.5 + GROUP_SLACK_S  # train_from_stream


def test_a_zero_call_timeout_is_refused_by_name():
    from config import ConfigError

    with pytest.raises(ConfigError, match="coordinator.call_timeout_s"):
        apply_overrides(get_recipe("tiny"), ["coordinator.call_timeout_s=0"])


class _Generator:
    """A generator's control surface; `frozen` never answers (fake: a SIGSTOPped actor's call)."""

    def __init__(self, frozen: bool = False):
        self.frozen, self.calls = frozen, []

    async def _answer(self, name: str):
        self.calls.append(name)
        if self.frozen:
            await asyncio.Event().wait()

    async def sleep(self, level):
        await self._answer("sleep")

    async def wake(self, tags=None):
        await self._answer("wake")

    async def health(self):
        await self._answer("health")
        return {"version": 0, "needs_weights": False}


async def test_fake_frozen_generator_ends_the_coordinator_s_wait_naming_it_and_the_call():
    from actors.coordinator.coordinator import Coordinator

    gens = [_Generator(), _Generator(frozen=True)]
    coord = Coordinator(_cfg(), RunContext(run_id="frozen"), [], [], generators=gens, learner=None, assembler=None)
    with pytest.raises(ActorCallTimeout) as e:
        await coord.generators.sleep(2)
    assert str(e.value) == "generator-1.sleep did not return within 0.75 s (the actor is frozen or overloaded)"
    assert gens[0].calls == gens[1].calls == ["sleep"]
    await coord.generators.wake(["weights"], targets=[gens[0]])  # a live one answers as ever


async def test_fake_frozen_generator_is_restarted_in_place_once_per_call():
    """A generator frozen past a control call's bound is restarted (restart_frozen: for a Ray actor,
    actors.shell.restart_in_place) and the call made once more on the new instance; a generator still
    frozen after that ends the wait naming it, with the restart's longer bound."""
    from actors.coordinator.coordinator import Coordinator

    gens = [_Generator(), _Generator(frozen=True)]
    coord = Coordinator(_cfg(), RunContext(run_id="frozen"), [], [], generators=gens, learner=None, assembler=None)
    restarted = []

    def restart(g):  # what Ray's restart gives: the same handle, a live instance behind it
        restarted.append(g)
        g.frozen = False
        return True

    coord.generators.restart = restart
    await coord.generators.sleep(2)
    assert restarted == [gens[1]] and coord.generators.frozen_restarts == 1
    assert gens[0].calls == ["sleep"] and gens[1].calls == ["sleep", "sleep"]

    coord.generators.restart = lambda g: restarted.append(g) or True  # restarted, and frozen again
    gens[1].frozen = True
    with pytest.raises(ActorCallTimeout) as e:
        await coord.generators.wake(["weights"])
    assert str(e.value) == "generator-1.wake did not return within 1 s (the actor is frozen or overloaded)"
    assert restarted == [gens[1], gens[1]] and coord.generators.frozen_restarts == 2


async def test_fake_frozen_generator_holding_a_step_s_late_groups_is_restarted_and_they_are_waited_for():
    """A step's wait for its groups that times out with some missing asks every generator (health, bounded): a
    frozen one, which holds them pending under its name, is restarted in place, and the wait goes on for the
    groups its new instance serves once resynced (WeightSync.heal), instead of the collect waiting its whole
    timeout again and failing them. A late step whose generators all answer is not waited for again.
    Stand-ins (fake): the restarted generator makes the groups it held once healed."""
    from actors.coordinator.coordinator import Coordinator
    from queues.messages import train_task_id

    live, frozen = _Generator(), _Generator(frozen=True)
    coord = Coordinator(_cfg(), RunContext(run_id="late"), [], [], generators=[live, frozen], learner=None,
                        assembler=None)
    ids = [train_task_id(3, k) for k in range(4)]
    coord.generated.record(ids[0], 1.0)  # the live generator's group; the frozen one holds the other three
    restarted = []

    def restart(g):  # what Ray's restart gives: the same handle, a live instance behind it
        restarted.append(g)
        g.frozen = False
        return True

    async def heal(version, timeout_s=2.0):  # resynced: the new instance serves its pending prompts first
        if not restarted:
            return 0
        for t in ids[1:]:
            coord.generated.record(t, 2.0)
        return 1

    coord.generators.restart, coord.weights.heal = restart, heal
    t0 = time.monotonic()
    await coord._wait_generated(ids, 2.0)
    waited = time.monotonic() - t0
    assert all(t in coord.generated.done for t in ids), "the restarted generator's groups were not waited for"
    assert restarted == [frozen] and coord.generators.frozen_restarts == 1 and frozen.calls == ["health", "health"]
    assert waited < 2.0 + 0.5 + 1.9  # the second wait ended with the groups, not at its timeout

    late = [train_task_id(4, 0)]  # late, but no generator is frozen: one wait, no restart
    t0 = time.monotonic()
    await coord._wait_generated(late, 1.0)
    assert late[0] not in coord.generated.done and coord.generators.frozen_restarts == 1 and time.monotonic() - t0 < 1.9
    assert live.calls == ["health", "health"]


async def test_fake_restarted_generator_is_resynced_during_an_evaluation():
    """A generator Ray restarted serves nothing until it has the current weights. An evaluation waits for its
    groups as a step does, resyncing restarted generators meanwhile (WeightSync.heal), instead of waiting its
    whole collect_eval timeout, twice, for groups that are never made (the soak's async hang). Stand-ins
    (fake): the restarted lone generator makes the evaluation's groups once healed; the assembler answers
    once they all exist."""
    from types import SimpleNamespace

    from actors.coordinator.coordinator import Coordinator

    cfg = _cfg("coordinator.step_timeout_s=60", "data.eval_samples=2")
    item = SimpleNamespace(prompt_id="p0", prompt_tokens=b"", db_id="d", db_path="/x", gold_sql="SELECT 1",
                           difficulty="simple")
    coord = Coordinator(cfg, RunContext(run_id="heal"), [], [item], generators=[], learner=None, assembler=None)
    published, heals = [], []

    async def publish(tasks):
        published.extend(t.task_id for t in tasks)
        return [t.task_id for t in tasks]

    async def heal(version, timeout_s=2.0):
        heals.append(1)
        for t in published:  # healed: the generator makes the groups it was waiting to make
            coord.generated.record(t, 0.0)
        return 1

    async def collect_eval(ids, timeout):
        assert all(t in coord.generated.done for t in ids), "collect_eval called before the groups existed"
        return {"eval_accuracy": 0.5, "eval_reward_mean": 0.25, "eval_sample_accuracy": 0.25}

    coord._publish, coord.weights.heal = publish, heal
    coord.assembler.actor = SimpleNamespace(collect_eval=collect_eval)  # the assembler (fake)
    result = await coord._eval()
    assert heals and result["eval_accuracy"] == 0.5 and result["eval_reward_mean"] == 0.25


class _Log:
    """Stands in for the coordinator's structlog logger: (level, event, fields) of each call."""

    def __init__(self):
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event, **kw):
        self.lines.append(("info", event, kw))

    def warning(self, event, **kw):
        self.lines.append(("warning", event, kw))


def _evaluating_coordinator(gen, log):
    """A coordinator over one stand-in generator, evaluating one held-out item (its groups appear once `gen`
    makes them: `coord.make_groups()`), with the assembler and the events consumer stand-ins (fake)."""
    from types import SimpleNamespace

    from actors.coordinator.coordinator import Coordinator

    item = SimpleNamespace(prompt_id="p0", prompt_tokens=b"", db_id="d", db_path="/x", gold_sql="SELECT 1",
                           difficulty="simple")
    coord = Coordinator(_cfg("coordinator.step_timeout_s=60", "data.eval_samples=2"), RunContext(run_id="silent"),
                        [], [item], generators=[gen], learner=None, assembler=None, log=log)
    published: list[str] = []

    async def publish(tasks):
        published.extend(t.task_id for t in tasks)
        return [t.task_id for t in tasks]

    def make_groups():
        for t in published:
            coord.generated.record(t, 0.0)

    async def collect_eval(ids, timeout):
        return {"eval_accuracy": 0.5, "eval_reward_mean": 0.25, "eval_sample_accuracy": 0.25}

    coord._publish, coord.make_groups = publish, make_groups
    coord.assembler.actor = SimpleNamespace(collect_eval=collect_eval)
    return coord


async def test_fake_generator_silent_in_the_run_s_last_evaluation_is_named_at_once_and_restarted_past_call_timeout_s():
    """The GPU run of 2026-12-05: mid-way through the evaluation after the last async step the engine's memory
    went (its generator's process gone; Ray restarting it), and the coordinator waited 39 s with nothing
    logged, its health checks failing silently round after round, bounded only by step_timeout_s. Now the
    first unanswered health check is a warning naming the generator and the call, and a generator silent past
    coordinator.call_timeout_s is restarted in place (then makes the evaluation's groups). Stand-ins (fake):
    a generator whose health never answers (a process Ray restarts answers nothing until it is up again).
    Before: the evaluation waited its 60 s bound here, silent."""
    gen, log = _Generator(frozen=True), _Log()
    coord = _evaluating_coordinator(gen, log)

    def restart(g):  # Ray's restart in place: the same handle, a live instance that serves its pending prompts
        g.frozen = False
        coord.make_groups()
        return True

    coord.generators.restart = restart
    t0 = time.monotonic()
    result = await asyncio.wait_for(coord._eval(), 15)
    assert result["eval_accuracy"] == 0.5 and time.monotonic() - t0 < 15
    warnings = [(e, kw) for level, e, kw in log.lines if level == "warning"]
    assert warnings[0] == ("generator not answering its health call (restarting, frozen or dead)",
                           {"generator": "generator-0", "call": "health", "error": warnings[0][1]["error"]})
    assert "generator-0.health did not return within 2 s" in warnings[0][1]["error"]
    event, kw = warnings[1]
    assert event == "generator frozen past its bound: restarted in place" and kw["generator"] == "generator-0"
    assert kw["error"].startswith("generator-0.health did not return within") and coord.generators.frozen_restarts == 1
    assert [kw["phase"] for level, e, kw in log.lines if e == "phase"] == ["evaluating", "evaluated"]


async def test_fake_generator_still_silent_after_its_restart_ends_the_evaluation_naming_it_and_the_call():
    """Restarted in place and silent again past twice coordinator.call_timeout_s: the wait ends with one line
    naming the generator and the call (ActorCallTimeout: the launcher's death path), not at step_timeout_s.
    Stand-ins (fake): a generator that never answers, restarted or not."""
    gen, log = _Generator(frozen=True), _Log()
    coord = _evaluating_coordinator(gen, log)
    coord.generators.restart = lambda g: True  # restarted, and silent again
    with pytest.raises(ActorCallTimeout) as e:
        await asyncio.wait_for(coord._eval(), 20)
    assert str(e.value).startswith("generator-0.health did not return within ")
    assert coord.generators.frozen_restarts == 1


async def test_fake_generator_the_heartbeat_restarted_is_not_restarted_again_by_heal_s_silence_clock():
    """The heartbeat and heal's silence clock read one restart record (GeneratorPool.restarted_at): a generator
    the heartbeat restarted while heal's clock ran counts as restarted once; heal does not restart it again
    when its own bound passes, and it ends the wait (ActorCallTimeout) past twice call_timeout_s after the
    heartbeat's restart. Stand-ins (fake): a generator that never answers, restarted or not. Before: heal
    restarted it a second time, about a second after the heartbeat had."""
    gen, log = _Generator(frozen=True), _Log()
    coord = _evaluating_coordinator(gen, log)
    coord.generators.restart = lambda g: True  # restarted, and silent again

    async def heartbeat_restart():
        await asyncio.sleep(1.5)  # heal's clock has run 1.5 s of its 2 s bound
        coord.generators.restart_in_place(gen, "ping", "3 heartbeats missed in a row",
                                          event="generator frozen (missed heartbeats): restarted in place")

    beat = asyncio.create_task(heartbeat_restart())
    t0 = time.monotonic()
    with pytest.raises(ActorCallTimeout) as e:
        await asyncio.wait_for(coord._eval(), 20)
    await beat
    assert str(e.value).startswith("generator-0.health did not return within ")
    assert coord.generators.frozen_restarts == 1  # the heartbeat's alone
    assert time.monotonic() - t0 >= 1.5 + 2 * 0.5  # twice call_timeout_s after the heartbeat's restart


async def test_an_error_of_the_call_itself_passes_as_is_even_a_timeout_error():
    class Learner:
        async def train_from_stream(self, step):
            raise TimeoutError("learner: no TrainBatch for step 3")

    with pytest.raises(TimeoutError, match="no TrainBatch") as e:
        await bounded(Learner().train_from_stream, 5.0, "learner", 3)
    assert not isinstance(e.value, ActorCallTimeout)


async def test_fake_frozen_rank_is_named_by_the_group_and_a_rank_s_error_ends_the_wait_at_once():
    from actors.learner.group import LearnerGroup

    group = LearnerGroup(["rank0", "rank1", "rank2"], call_timeout_s=0.3)

    async def answer(v):
        return v

    async def never():
        await asyncio.Event().wait()

    async def fail():
        raise RuntimeError("rank 2: CUDA out of memory")

    assert await group._gather("sleep", [(0, answer(0)), (1, answer(1))]) == [0, 1]
    with pytest.raises(ActorCallTimeout, match=r"^learner.sleep on rank\(s\) \[1\] of 3 did not return within 0.3 s"):
        await group._gather("sleep", [(0, answer(0)), (1, never()), (2, answer(2))])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        await group._gather("save", [(0, never()), (2, fail())], bound_s=60.0)
    assert time.monotonic() - t0 < 30.0  # the error, not the 60 s bound, ended the wait


# ----------------------------------------------------------------------------- real Ray, SIGSTOP


