"""The one stream-consumer loop every stage uses: pending first, reclaim, heartbeat, ack after publish.

A `Worker` reads one `Stream` as one consumer. Push mode, `run()`: it runs `handle(entry_id, data)`
for each entry, up to `concurrency` at once (a slow entry holds one slot, never the others) -- the
generator, the scorer, the assembler, the coordinator's events. Pull mode, `take(pick, timeout_s)`:
the caller asks for one entry at a time and `pick` chooses it -- the learner's batch for step s.
Order of intake, both modes: the consumer's own pending entries first (all of them: what it held
before a restart), then new ones; every `reclaim_every_s` (one cadence, from `reclaim_idle_s`)
entries idle on any consumer longer than `reclaim_idle_s` are taken over (XAUTOCLAIM). A heartbeat
resets the idle time of the entries in flight here (`Stream.touch`) so no live peer takes them while
they are being handled.

Invariants:
- Nothing is acked before its output is published. `acks="worker"` (the default): an entry is acked
  only when `handle` returned without raising, and `handle` returns only after its output is
  published; a handler that raises leaves its entry pending. `acks="handler"` (the assembler, which
  holds a step's groups until their TrainBatch is published): the worker never acks; the handler, or
  its owner later, acks once the output is out. Pull mode never acks: the caller does, after use.
- A dead consumer's entries are reclaimed by a live one after `reclaim_idle_s`; a live consumer's
  in-flight entries are kept fresh by the heartbeat (period reclaim_idle_s / 3), so they are not.
  Entries a handler holds after returning (`acks="handler"`) or that `take` passed over are not
  heartbeaten: a reclaim hands them back to their owner, whose handler / `pick` sees them again.
- One entry is never handled twice at once by the same worker (a reclaim of our own entry is skipped).
- Every wait is bounded: reads block at most `block_ms`, `stop()` ends intake within the read
  bound, and the entries in flight then get `drain_s` to finish (then cancelled, left pending);
  `drain_s=None` waits for them, for a handler that bounds itself (the generator: the engine's
  max_tokens, and its pause timeout's abort). `take` returns None after `timeout_s`.
- `pulling` is True while a read is under way, and what a read returns is spawned before it drops,
  so "not pulling and nothing in flight" means nothing taken is unhandled (the generator's pause).
- `on_error="raise"` ends `run()` with a handler's exception (Ray restarts the actor);
  `on_error="leave"` logs it and leaves the entry pending for a reclaim.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from queues.errors import one_line

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[None]]
T = TypeVar("T")


def reclaim_every_s(reclaim_idle_s: float) -> float:
    """The one reclaim cadence: a quarter of the idle bound, at least every 0.5 s apart."""
    return max(0.5, reclaim_idle_s / 4)


def heartbeat_every_s(reclaim_idle_s: float) -> float:
    return max(0.2, reclaim_idle_s / 3)


class Worker:
    """Consumes `stream` as `consumer`: with `handle`, `run()` until `stop()`; or `take()` one at a time."""

    def __init__(self, stream, consumer: str, handle: Handler | None = None, *, concurrency: int = 8,
                 reclaim_idle_s: float = 30.0, block_ms: int = 200, heartbeat: bool = True,
                 on_error: str = "raise", drain_s: float | None = 0.0, read_count: int = 64,
                 acks: str = "worker", may_pull: Callable[[], bool] | None = None,
                 on_change: Callable[[], None] | None = None):
        if on_error not in ("raise", "leave"):
            raise ValueError(f"on_error must be 'raise' or 'leave', got {on_error!r}")
        if acks not in ("worker", "handler"):
            raise ValueError(f"acks must be 'worker' or 'handler', got {acks!r}")
        self.acks = acks
        self.stream = stream
        self.consumer = consumer
        self.handle = handle
        self.concurrency = max(1, int(concurrency))
        self.reclaim_idle_s = float(reclaim_idle_s)
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.block_ms = int(block_ms)
        self.heartbeat = heartbeat
        self.on_error = on_error
        self.drain_s = drain_s
        self.read_count = max(1, int(read_count))
        self.may_pull = may_pull  # e.g. the generator's pause: no intake while it says False
        self.on_change = on_change  # called when `pulling` or `inflight` changes (the generator's pause waits on it)
        self.pulling = False  # a read is under way: what it returns is spawned before `pulling` drops
        self.inflight: dict[str, asyncio.Task] = {}
        self.reclaimed = 0
        self.handled = 0
        self.failed = 0
        self._group_ready = False
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Re-checks `may_pull` now (e.g. after a resume) instead of at the next bounded wait."""
        self._changed.set()

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.handle is None:
            raise ValueError(f"{self.stream.key} {self.consumer}: run() needs a handler (take() is the pull mode)")
        await self.stream.ensure_group()
        beat = asyncio.create_task(self._heartbeat()) if self.heartbeat else None
        failure: list[BaseException] = []
        try:
            backlog = await self.stream.pending_all(self.consumer)
            next_reclaim = time.monotonic() + reclaim_every_s(self.reclaim_idle_s)
            while not self._stop.is_set():
                self._raise_failures(failure)
                if self.may_pull is not None and not self.may_pull():
                    await self._wait_change(0.2)
                    continue
                free = self.concurrency - len(self.inflight)
                if free <= 0:
                    await self._wait_change(1.0)
                    continue
                entries: list[tuple[str, bytes]] = []
                self._set_pulling(True)
                try:
                    if backlog:
                        entries, backlog = backlog[:free], backlog[free:]
                    else:
                        if time.monotonic() >= next_reclaim:
                            next_reclaim = time.monotonic() + reclaim_every_s(self.reclaim_idle_s)
                            got = [(e, d) for e, d in await self.stream.reclaim(self.consumer, self.reclaim_idle_ms, count=free)
                                   if e not in self.inflight]
                            self.reclaimed += len(got)
                            entries = got
                        if not entries:
                            entries = await self.stream.consume(self.consumer, count=min(free, self.read_count),
                                                                block_ms=self.block_ms)
                    for eid, data in entries:
                        self._spawn(eid, data, failure)  # after a stop too: taken, so handled (or left pending)
                finally:
                    self._set_pulling(False)
            self._raise_failures(failure)
            if self.inflight and (self.drain_s is None or self.drain_s > 0):
                await asyncio.wait(list(self.inflight.values()), timeout=self.drain_s)
            self._raise_failures(failure)
        finally:
            if beat is not None:
                beat.cancel()
            for task in list(self.inflight.values()):
                task.cancel()  # left pending: reclaimed, or taken first by our restart

    async def take(self, pick: Callable[[str, bytes], Awaitable[T | None]], timeout_s: float) -> tuple[str, T] | None:
        """Pull mode: offers entries to `pick(entry_id, data)` until it returns something other than
        None; returns (that entry's id, what `pick` returned), or None after `timeout_s`.

        Offered in the module's order: this consumer's pending entries, then new ones (a read blocks
        at most `block_ms`), a reclaim on the one cadence when nothing new came, and this consumer's
        pending list again (an entry Redis delivered on a read whose reply was lost on a reconnect sits
        there). Nothing is acked here: `pick` may ack an entry it discards, an entry it passes over stays
        pending and is offered again, and the caller acks the taken entry once it is used."""
        if not self._group_ready:
            await self.stream.ensure_group()
            self._group_ready = True
        deadline = time.monotonic() + timeout_s
        next_reclaim = time.monotonic() + reclaim_every_s(self.reclaim_idle_s)
        entries = await self.stream.pending_all(self.consumer)
        while time.monotonic() < deadline:
            if not entries:
                left_ms = int((deadline - time.monotonic()) * 1000)
                entries = await self.stream.consume(self.consumer, count=self.read_count,
                                                    block_ms=max(1, min(self.block_ms, left_ms)))
            if not entries and time.monotonic() >= next_reclaim:
                next_reclaim = time.monotonic() + reclaim_every_s(self.reclaim_idle_s)
                entries = await self.stream.reclaim(self.consumer, self.reclaim_idle_ms, count=self.read_count)
                self.reclaimed += len(entries)
            if not entries:
                entries = await self.stream.pending_all(self.consumer)
            for eid, data in entries:
                got = await pick(eid, data)
                if got is not None:
                    return eid, got
            entries = []
        return None

    def _raise_failures(self, failure: list[BaseException]) -> None:
        if failure:
            raise failure[0]

    async def _wait_change(self, timeout_s: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _changed_now(self) -> None:
        self._changed.set()
        if self.on_change is not None:
            self.on_change()

    def _set_pulling(self, value: bool) -> None:
        self.pulling = value
        self._changed_now()

    def _spawn(self, eid: str, data: bytes, failure: list[BaseException]) -> None:
        if eid in self.inflight:
            return
        self.inflight[eid] = asyncio.create_task(self._one(eid, data, failure))
        self._changed_now()

    async def _one(self, eid: str, data: bytes, failure: list[BaseException]) -> None:
        try:
            await self.handle(eid, data)
            if self.acks == "worker":
                await self.stream.ack([eid])  # only now: its output is published
            self.handled += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.failed += 1
            if self.on_error == "raise":
                failure.append(e)
            else:
                log.error("%s %s: %s left pending: %s", self.stream.key, self.consumer, eid, one_line(e))
        finally:
            self.inflight.pop(eid, None)
            self._changed_now()

    async def _heartbeat(self) -> None:
        """Resets the idle time of our in-flight entries so no live peer reclaims them."""
        period = heartbeat_every_s(self.reclaim_idle_s)
        while True:
            await asyncio.sleep(period)
            ids = list(self.inflight)
            if ids:
                try:
                    await self.stream.touch(self.consumer, ids)
                except Exception as e:  # best effort: a missed beat only risks duplicate work
                    log.warning("%s %s: heartbeat failed: %s", self.stream.key, self.consumer, one_line(e))
