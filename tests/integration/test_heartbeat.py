"""The generators' heartbeat (actors/coordinator/heartbeat.py) on real Ray actors with the generator's own `ping`
and RAY_OPTIONS (its concurrency group): a SIGSTOPped one is restarted in place by the heartbeat, and one whose
main event loop is blocked (busy) keeps answering and is never restarted. The plain stand-in tests are in
tests/unit/test_heartbeat.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from actors.coordinator.heartbeat import Heartbeat

# ----------------------------------------------------------------------------- real Ray, SIGSTOP


def _standin_class():
    from actors.generator.shell import GeneratorShell

    class GeneratorStandIn:
        """The generator's own `ping` and RAY_OPTIONS (its heartbeat concurrency group, restartable); `busy`
        blocks its main event loop (a generator busy beyond what its loop can interleave)."""

        RAY_OPTIONS = GeneratorShell.RAY_OPTIONS
        ping = GeneratorShell.ping

        async def busy(self, seconds: float) -> None:
            time.sleep(seconds)  # noqa: ASYNC251 - the main event loop does nothing else meanwhile (the point)

        async def pid(self) -> int:
            return os.getpid()

    return GeneratorStandIn


def test_a_sigstopped_generator_is_restarted_by_the_heartbeat_and_a_busy_one_is_not(local_ray):
    import ray

    from actors.shell import ray_actor, restart_in_place

    cls = ray_actor(_standin_class())
    busy, frozen = cls.options(num_cpus=0).remote(), cls.options(num_cpus=0).remote()
    gens = [busy, frozen]
    pids = ray.get([g.pid.remote() for g in gens], timeout=120)
    restarted: list = []

    def restart(g, misses, error):
        restarted.append(gens.index(g))
        return restart_in_place(g)

    # timeout_s: a ping served on its own thread answers in milliseconds; 3 s leaves room for the loaded 2 cores
    beat = Heartbeat(gens, restart, lambda g: f"generator-{gens.index(g)}", period_s=0.5, timeout_s=3.0, misses=3)

    async def scenario():
        for _ in range(20):  # both answer once (bounded)
            await beat.beat()
            if beat.answered == {0, 1}:
                break
        assert beat.answered == {0, 1}
        blocking = busy.busy.remote(4 * beat.timeout_s)  # its main loop blocked past misses x timeout
        os.kill(pids[1], signal.SIGSTOP)
        rounds = []
        for n in range(1, 3 * beat.misses + 1):
            if await beat.beat():
                rounds.append(n)
                break
        await asyncio.wrap_future(blocking.future())
        return rounds

    try:
        rounds = asyncio.run(scenario())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    # noticed at the misses-th round after the freeze (each round bounded by timeout_s), by the heartbeat alone
    assert rounds == [beat.misses] and restarted == [1], (rounds, restarted, beat.missed)
    assert 0 not in beat.missed  # the busy one answered every ping while its main loop was blocked
    new_pid = ray.get(frozen.pid.remote(), timeout=120)  # restarted in place under the same handle
    assert new_pid != pids[1] and ray.get(busy.pid.remote(), timeout=60) == pids[0]
    for g in gens:
        ray.kill(g, no_restart=True)
