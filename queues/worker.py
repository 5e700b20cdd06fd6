"""The one stream-consumer loop every stage uses: pending first, reclaim, heartbeat, ack after publish.

A `Worker` reads one `Stream` as one consumer and runs `handle(entry_id, data)` for each entry, up
to `concurrency` at once (a slow entry holds one slot, never the others). Order of intake: the
consumer's own pending entries first (what it held before a restart), then new ones; every
`reclaim_every_s` (one cadence, from `reclaim_idle_s`) entries idle on any consumer longer than
`reclaim_idle_s` are taken over (XAUTOCLAIM). A heartbeat resets the idle time of the entries in
flight here (`Stream.touch`) so no live peer takes them while they are being handled.

Invariants:
- Each entry is handled until it is acked: an entry is acked only when `handle` returned without
  raising, and `handle` returns only after its output is published. So nothing is acked before
  its output is published, and a handler that raises leaves its entry pending.
- A dead consumer's entries are reclaimed by a live one after `reclaim_idle_s`; a live consumer's
  in-flight entries are kept fresh by the heartbeat (period reclaim_idle_s / 3), so they are not.
- One entry is never handled twice at once by the same worker (a reclaim of our own entry is skipped).
- Every wait is bounded: reads block at most `block_ms`, `stop()` ends intake within the read
  bound, and the entries in flight then get `drain_s` to finish (then cancelled, left pending);
  `drain_s=None` waits for them, for a handler that bounds itself (the generator: the engine's
  max_tokens, and its pause timeout's abort).
- `pulling` is True while a read is under way, and what a read returns is spawned before it drops,
  so "not pulling and nothing in flight" means nothing taken is unhandled (the generator's pause).
- `on_error="raise"` ends `run()` with a handler's exception (Ray restarts the actor);
  `on_error="leave"` logs it and leaves the entry pending for a reclaim.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from queues.errors import one_line

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[None]]


def reclaim_every_s(reclaim_idle_s: float) -> float:
    """The one reclaim cadence: a quarter of the idle bound, at least every 0.5 s apart."""
    return max(0.5, reclaim_idle_s / 4)


def heartbeat_every_s(reclaim_idle_s: float) -> float:
    return max(0.2, reclaim_idle_s / 3)


class Worker:
    """Consumes `stream` as `consumer` with `handle`; `run()` until `stop()`."""

    def __init__(self, stream, consumer: str, handle: Handler, *, concurrency: int = 8,
                 reclaim_idle_s: float = 30.0, block_ms: int = 200, heartbeat: bool = True,
                 on_error: str = "raise", drain_s: float | None = 0.0, read_count: int = 64,
                 may_pull: Callable[[], bool] | None = None, on_change: Callable[[], None] | None = None):
        if on_error not in ("raise", "leave"):
            raise ValueError(f"on_error must be 'raise' or 'leave', got {on_error!r}")
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
        await self.stream.ensure_group()
        beat = asyncio.create_task(self._heartbeat()) if self.heartbeat else None
        failure: list[BaseException] = []
        try:
            backlog = await self.stream.pending_mine(self.consumer, count=max(100, self.concurrency))
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
