"""The generators' heartbeat: a frozen generator noticed within seconds, not at the next late step.

A frozen generator (SIGSTOP, a stuck device) is alive to Ray and silent; before this it was first noticed
when a step's groups were late (coordinator.step_timeout_s) and a health call then ran past
coordinator.call_timeout_s (~75 s in tests/unit/test_frozen_actors.py). The heartbeat pings every generator
every `coordinator.heartbeat_s` seconds, each ping bounded by `coordinator.heartbeat_timeout_s`; a
generator that misses `coordinator.heartbeat_misses` pings in a row is frozen and is restarted in place
(the pool's `restart_in_place`, actors/handles.py GeneratorPool: Ray kills the process and starts the
actor again under the same handle; the step's wait resyncs it, WeightSync.heal, and its pending prompts
are taken back by the new instance). So a freeze is noticed within about
heartbeat_s * heartbeat_misses + heartbeat_timeout_s (15 s with the defaults).

The ping is the generator's `ping` (actors/generator/shell.py), served in a concurrency group of its own
(a thread and event loop of its own in the actor), so a generator busy generating, loading weights or
blocking its main event loop still answers; only a process that cannot run at all misses.

Invariants:
- Every ping has a bound (heartbeat_timeout_s) and the rounds never overlap: a round waits for all of
  its pings (each bounded) before the next period starts.
- Only timeouts count as misses, and only for a generator that has answered since it was started or
  restarted: one still starting (its constructor imports and builds the engine; Ray queues the ping)
  or being restarted by Ray after a crash (the ping raises) is not judged, so a restart is never
  repeated while the new instance starts. A frozen start is left to the bounded control calls.
- One answer resets a generator's misses: a ping slowed by load now and then is never a restart.
- A restart made elsewhere (WeightSync.heal's silence clock, a control call's bound) is read from the pool
  (`restarted_at`): a generator restarted since its last answer is not judged until it answers again.
- Every restart is a warning naming the generator and its misses, counted in the pool's
  `frozen_restarts` (saved with the cursor), as the pool's own restarts of a frozen call.
- Generators without `ping` (plain objects in tests) are not pinged; heartbeat_s = 0 turns it off.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.handles import bounded
from actors.shell import ActorCallTimeout


@dataclass
class Heartbeat:
    """Pings `generators` every `period_s` (each bounded by `timeout_s`); `misses` misses in a row ->
    `restart(g, misses, last_miss)` (True when it restarted g)."""

    generators: list
    restart: Callable[[Any, int, str], bool]  # (generator, misses, the last miss's line) -> restarted
    label: Callable[[Any], str]
    period_s: float = 4.0
    timeout_s: float = 3.0
    misses: int = 3
    missed: dict[int, int] = field(default_factory=dict)  # generator index -> misses in a row
    answered: set[int] = field(default_factory=set)  # indices that answered since their (re)start
    last_miss: dict[int, str] = field(default_factory=dict)  # index -> its last miss's one line
    restarts: int = 0
    # generator -> time.monotonic() of its last restart by anyone (GeneratorPool.restarted_at); 0.0: never
    restarted_at: Callable[[Any], float] = lambda g: 0.0
    answered_at: dict[int, float] = field(default_factory=dict)  # index -> when it last answered

    async def _ping(self, i: int, g: Any) -> None:
        try:
            await bounded(g.ping, self.timeout_s, self.label(g))
        except ActorCallTimeout as e:
            if self.restarted_at(g) > self.answered_at.get(i, 0.0):
                self.answered.discard(i)  # restarted since it last answered (WeightSync.heal): not judged yet
                self.missed.pop(i, None)
            if i in self.answered:
                self.missed[i] = self.missed.get(i, 0) + 1
                self.last_miss[i] = str(e)
            return
        except Exception:  # noqa: BLE001 - Ray restarting it after a crash: not judged until it answers
            self.answered.discard(i)
            self.missed.pop(i, None)
            return
        self.answered.add(i)
        self.answered_at[i] = time.monotonic()
        self.missed.pop(i, None)

    async def beat(self) -> list[int]:
        """One round: every generator with `ping` pinged at once (bounded); the indices restarted."""
        pinged = [(i, g) for i, g in enumerate(self.generators) if hasattr(g, "ping")]
        await asyncio.gather(*(self._ping(i, g) for i, g in pinged))
        restarted = []
        for i, g in pinged:
            if self.missed.get(i, 0) >= self.misses and self.restart(g, self.missed[i], self.last_miss.get(i, "")):
                self.missed.pop(i, None)
                self.last_miss.pop(i, None)
                self.answered.discard(i)  # the new instance is judged once it has answered
                self.restarts += 1
                restarted.append(i)
        return restarted

    async def run(self) -> None:
        """Rounds every period_s until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.beat()
            await asyncio.sleep(max(0.0, self.period_s - (loop.time() - started)))


def start_heartbeat(coordinator: Any) -> asyncio.Task | None:
    """The coordinator's heartbeat task over its generator pool (None when coordinator.heartbeat_s is 0); a
    restart is the pool's `restart_in_place` (counted in its `frozen_restarts`, one warning). Cancel it to stop."""
    cc, pool = coordinator.cfg.coordinator, coordinator.generators
    if cc.heartbeat_s <= 0:
        return None

    def restart(g: Any, misses: int, error: str) -> bool:
        return pool.restart_in_place(g, "ping", f"{misses} heartbeats missed in a row: {error}",
                                     event="generator frozen (missed heartbeats): restarted in place")

    beat = Heartbeat(pool.actors, restart, pool.label, cc.heartbeat_s, cc.heartbeat_timeout_s, cc.heartbeat_misses,
                     restarted_at=pool.restarted_at)
    coordinator.heartbeat = beat
    return asyncio.create_task(beat.run(), name="generator-heartbeat")


async def stop_heartbeat(task: asyncio.Task | None) -> None:
    """Cancels the heartbeat task and waits for it (a round's pings are bounded)."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
