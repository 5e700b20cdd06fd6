"""The generators' heartbeat (actors/coordinator/heartbeat.py): a frozen generator is restarted in place
after `misses` bounded pings in a row, so within misses rounds (each round's pings bounded by timeout_s,
the rounds heartbeat_s apart: ~15 s with the defaults, against step_timeout_s + call_timeout_s before);
a generator that is slow now and then, still starting, or being restarted by Ray is not.

Plain stand-ins (fake: a frozen generator is a ping that never answers); the real Ray actors (a SIGSTOPped
generator) are in tests/integration/test_heartbeat.py.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.coordinator.heartbeat import Heartbeat, start_heartbeat, stop_heartbeat
from actors.handles import CallBounds, GeneratorPool
from config import ConfigError, apply_overrides
from config.recipes import get_recipe


class _Gen:
    """A generator's ping; `frozen`: never answers (fake: a SIGSTOPped actor), `slow`: answers after `slow` s,
    `starting`: raises (Ray restarting it)."""

    def __init__(self, frozen: bool = False, slow: float = 0.0, starting: bool = False):
        self.frozen, self.slow, self.starting, self.pings = frozen, slow, starting, 0

    async def ping(self) -> int:
        self.pings += 1
        if self.starting:
            raise RuntimeError("ActorUnavailableError: the actor is restarting")
        if self.frozen:
            await asyncio.Event().wait()
        await asyncio.sleep(self.slow)
        return 1


def _beat(gens, restarted, misses=3):
    def restart(g, misses, error):
        restarted.append(g)
        g.frozen = False  # the new instance answers
        return True
    return Heartbeat(gens, restart, lambda g: f"generator-{gens.index(g)}", period_s=0.0, timeout_s=0.05,
                     misses=misses)


async def test_fake_frozen_generator_is_restarted_after_misses_rounds_in_a_row_and_judged_again_once_it_answers():
    gens = [_Gen(), _Gen()]
    restarted: list = []
    beat = _beat(gens, restarted)
    assert await beat.beat() == []  # both answered: judged from now on
    gens[1].frozen = True
    assert [await beat.beat() for _ in range(3)] == [[], [], [1]]  # the third miss in a row restarts it
    assert restarted == [gens[1]] and beat.restarts == 1 and 1 not in beat.answered
    gens[1].frozen = True  # frozen again before its new instance ever answered: not judged (it is starting)
    assert [await beat.beat() for _ in range(5)] == [[]] * 5 and beat.restarts == 1
    gens[1].frozen = False
    await beat.beat()
    gens[1].frozen = True
    assert [await beat.beat() for _ in range(3)] == [[], [], [1]] and beat.restarts == 2


async def test_fake_slow_now_and_then_starting_or_restarting_generators_are_never_restarted():
    slow, starting, late = _Gen(), _Gen(starting=True), _Gen(frozen=True)
    gens = [slow, starting, late]
    restarted: list = []
    beat = _beat(gens, restarted)
    for round_ in range(12):
        slow.slow = 0.2 if round_ % 3 else 0.0  # two misses in a row at most, then an answer
        await beat.beat()
    assert restarted == [] and beat.missed.get(0, 0) < 3
    assert 1 not in beat.answered and 2 not in beat.answered  # never answered: never judged
    assert starting.pings == late.pings == 12  # yet asked every round, each ping bounded


async def test_the_coordinator_s_heartbeat_counts_and_logs_its_restarts_and_stops():
    class _Log:
        def __init__(self):
            self.events: list = []

        def warning(self, event, **kw):
            self.events.append(("warning", event, kw))

    class _Coordinator:
        def __init__(self, cfg, gens):
            self.cfg, self.log, self.restarted = cfg, _Log(), []
            self.generators = GeneratorPool(gens, CallBounds.of(cfg), log=self.log,
                                            restart=lambda g: self.restarted.append(g) or True)

    cfg = apply_overrides(get_recipe("tiny"), ["coordinator.heartbeat_s=0.01", "coordinator.heartbeat_timeout_s=0.05",
                                              "coordinator.heartbeat_misses=2"])
    gens = [_Gen()]
    c = _Coordinator(cfg, gens)
    task = start_heartbeat(c)
    for _ in range(200):  # bounded: until it answered once
        if c.heartbeat.answered:
            break
        await asyncio.sleep(0.01)
    gens[0].frozen = True
    for _ in range(500):
        if c.restarted:
            break
        await asyncio.sleep(0.01)
    await stop_heartbeat(task)
    assert task.done() and c.restarted == [gens[0]] and c.generators.frozen_restarts == 1
    (line,) = [e for e in c.log.events if "restarted in place" in e[1]]
    assert line[2]["generator"] == "generator-0" and line[2]["call"] == "ping"
    assert "2 heartbeats missed" in line[2]["error"] and "did not return within" in line[2]["error"]
    off = apply_overrides(get_recipe("tiny"), ["coordinator.heartbeat_s=0"])
    assert start_heartbeat(_Coordinator(off, gens)) is None


def test_heartbeat_settings_are_checked_by_name():
    for key in ("coordinator.heartbeat_s=-1", "coordinator.heartbeat_timeout_s=0", "coordinator.heartbeat_misses=0"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            apply_overrides(get_recipe("tiny"), [key])


async def test_fake_generator_restarted_elsewhere_is_not_judged_until_it_answers_again():
    """A restart the heartbeat did not make (WeightSync.heal's silence clock, GeneratorPool.restarted_at) starts
    the new instance's clock: its pings timing out while it starts are not misses, so the heartbeat never
    restarts it a second time; once it answers it is judged again."""
    gens = [_Gen()]
    restarted: list = []
    at = {"t": 0.0}
    beat = _beat(gens, restarted)
    beat.restarted_at = lambda g: at["t"]
    await beat.beat()  # answered: judged from now on
    gens[0].frozen = True
    await beat.beat()  # one miss
    at["t"] = time.monotonic()  # heal restarted it in place; its new instance is starting (silent)
    assert [await beat.beat() for _ in range(5)] == [[]] * 5 and restarted == [] and 0 not in beat.answered
    gens[0].frozen = False
    await beat.beat()
    gens[0].frozen = True
    assert [await beat.beat() for _ in range(3)] == [[], [], [0]] and restarted == [gens[0]]
