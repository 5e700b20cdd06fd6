"""The generators' heartbeat: a frozen generator noticed within seconds, not at the next late step.

A frozen generator (SIGSTOP, a stuck device) is alive to Ray and silent; before this it was first noticed
when a step's groups were late (coordinator.step_timeout_s) and a health call then ran past
coordinator.call_timeout_s (~75 s in tests/test_frozen_actors.py). The heartbeat pings every generator
every `coordinator.heartbeat_s` seconds, each ping bounded by `coordinator.heartbeat_timeout_s`; a
generator that misses `coordinator.heartbeat_misses` pings in a row is frozen and is restarted in place
(the coordinator's `restart_frozen`, actors.shell.restart_in_place: Ray kills the process and starts the
actor again under the same handle; the step's wait resyncs it, heal_generators, and its pending prompts
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
- Every restart is a warning naming the generator and its misses, counted in the coordinator's
  `frozen_restarts` (saved with the cursor), as the restarts of actors/coordinator/bounds.py.
- Generators without `ping` (plain objects in tests) are not pinged; heartbeat_s = 0 turns it off.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from actors.shell import ActorCallTimeout, call_within


@dataclass
class Heartbeat:
    """Pings `generators` every `period_s` (each bounded by `timeout_s`); `misses` misses in a row ->
    `restart(g)` (True when it restarted g) and `on_restart(label, misses)`."""

    generators: list
    restart: Callable[[Any], bool]
    label: Callable[[Any], str]
    period_s: float = 4.0
    timeout_s: float = 3.0
    misses: int = 3
    on_restart: Callable[[str, int, str], None] = lambda label, misses, error: None
    missed: dict[int, int] = field(default_factory=dict)  # generator index -> misses in a row
    answered: set[int] = field(default_factory=set)  # indices that answered since their (re)start
    last_miss: dict[int, str] = field(default_factory=dict)  # index -> its last miss's one line
    restarts: int = 0

    async def _ping(self, i: int, g: Any) -> None:
        try:
            await call_within(self.timeout_s, self.label(g), g, "ping")
        except ActorCallTimeout as e:
            if i in self.answered:
                self.missed[i] = self.missed.get(i, 0) + 1
                self.last_miss[i] = str(e)
            return
        except Exception:  # noqa: BLE001 - Ray restarting it after a crash: not judged until it answers
            self.answered.discard(i)
            self.missed.pop(i, None)
            return
        self.answered.add(i)
        self.missed.pop(i, None)

    async def beat(self) -> list[int]:
        """One round: every generator with `ping` pinged at once (bounded); the indices restarted."""
        pinged = [(i, g) for i, g in enumerate(self.generators) if hasattr(g, "ping")]
        await asyncio.gather(*(self._ping(i, g) for i, g in pinged))
        restarted = []
        for i, g in pinged:
            if self.missed.get(i, 0) >= self.misses and self.restart(g):
                self.on_restart(self.label(g), self.missed.pop(i), self.last_miss.pop(i, ""))
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
    """The coordinator's heartbeat task over its generators (None when coordinator.heartbeat_s is 0); it
    restarts with the coordinator's `restart_frozen` and counts in its `frozen_restarts`. Cancel it to stop."""
    cc = coordinator.cfg.coordinator
    if cc.heartbeat_s <= 0:
        return None

    def restarted(label: str, misses: int, error: str) -> None:
        coordinator.frozen_restarts = getattr(coordinator, "frozen_restarts", 0) + 1
        if getattr(coordinator, "log", None) is not None:
            coordinator.log.warning("generator frozen (missed heartbeats): restarted in place", generator=label,
                                    call="ping", misses=misses, heartbeat_s=cc.heartbeat_s, error=error)

    beat = Heartbeat(coordinator.generators, coordinator.restart_frozen, coordinator.generator_label,
                     cc.heartbeat_s, cc.heartbeat_timeout_s, cc.heartbeat_misses, restarted)
    coordinator.heartbeat = beat
    return asyncio.create_task(beat.run(), name="generator-heartbeat")


async def stop_heartbeat(task: asyncio.Task | None) -> None:
    """Cancels the heartbeat task and waits for it (a round's pings are bounded)."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
