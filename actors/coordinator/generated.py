"""Which published tasks a generator has finished: the run's "generated" events, as the coordinator waits on them.

A generator publishes an Event(kind="generated") on the events stream when a task's group is done; the
coordinator's step waits until every task of the step has one (actors/coordinator/coordinator.py).

Invariants:
- One consumer loop (queues.worker.Worker) reads the events stream: each "generated" notice is recorded (task
  id -> the time it was generated), then acked; other kinds are acked and ignored.
- The consumer's failure (Redis gone for good, an event it cannot decode) ends the next wait with that error,
  never a wait that only runs out its bound; the undecodable entry stays pending, never acked.
- Every wait has a bound: `wait` returns at its timeout with tasks still missing, and meanwhile calls its
  `tick` once a second (the coordinator resyncs generators Ray restarted, so they can serve what is missing).
- What it holds is bounded: `forget(before_step)` drops the tasks of earlier steps (evaluation tasks too).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from queues.messages import Event, codec, task_step

TICK_S = 1.0


class GeneratedEvents:
    """The generated-events record: `done` maps task id -> when its group was generated."""

    def __init__(self) -> None:
        self.done: dict[str, float] = {}
        self.stream = self.worker = None
        self._task: asyncio.Task | None = None
        self._arrived = asyncio.Event()

    def start(self, stream, group: str, reclaim_idle_s: float) -> None:
        """Consumes `stream` (group `group`) in the background, from the running event loop."""
        from queues.worker import Worker

        self.stream = stream
        self.worker = Worker(stream, group, self._on_event, concurrency=64, read_count=512,
                             reclaim_idle_s=reclaim_idle_s, heartbeat=False, on_error="raise")
        self._task = asyncio.create_task(self.worker.run())

    async def stop(self) -> None:
        """Stops the consumer within its read bound."""
        if self._task is not None:
            self.worker.stop()
            await asyncio.wait([self._task], timeout=5.0)
            self._task.cancel()

    async def _on_event(self, entry_id: str, data: bytes) -> None:
        ev = codec(Event).decode(data)
        if ev.kind == "generated":
            self.record(ev.task_id, ev.at)

    def record(self, task_id: str, at: float) -> None:
        """`task_id`'s group was generated at `at` (what a "generated" event says); wakes a wait."""
        self.done[task_id] = at
        self._arrived.set()

    def check(self) -> None:
        """Raises the consumer's failure (or that it ended) once it is no longer running; a record never started
        (tests that `record` themselves) has nothing to check."""
        if self._task is not None and self._task.done():
            if not self._task.cancelled() and self._task.exception() is not None:
                raise self._task.exception()
            raise RuntimeError(f"coordinator: the events consumer of {self.stream.key} ended")

    def missing(self, task_ids: list[str]) -> int:
        return sum(t not in self.done for t in task_ids)

    def forget(self, before_step: int) -> None:
        """Drops the tasks of steps before `before_step` (evaluation tasks too)."""
        self.done = {t: at for t, at in self.done.items() if task_step(t) is None or task_step(t) >= before_step}

    async def wait(self, task_ids: list[str], timeout_s: float, tick: Callable[[], Awaitable[None]]) -> float:
        """Returns when every task is generated, or at the timeout: the time the last of them was generated
        (now when none was). `tick` runs once a second meanwhile."""
        deadline = time.monotonic() + timeout_s
        next_tick = time.monotonic() + TICK_S
        while time.monotonic() < deadline:
            self.check()
            if not self.missing(task_ids):
                break
            self._arrived.clear()
            if not self.missing(task_ids):
                break
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.0, min(next_tick, deadline) - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_tick:
                await tick()
                next_tick = time.monotonic() + TICK_S
        return max((self.done.get(t, 0.0) for t in task_ids), default=time.time())
