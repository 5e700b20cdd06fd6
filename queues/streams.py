"""One stage's Redis stream, consumed by a consumer group, over redis.asyncio.

Invariants:
- A message leaves a consumer's pending list only by `ack`; a consumer that dies leaves its
  messages pending, and `reclaim` (XAUTOCLAIM) hands them to a live consumer after they have
  been idle `min_idle_ms`. So a dead replica costs time, never data.
- Entries are trimmed (XTRIM MINID) only below the oldest entry some group still needs
  (its oldest pending entry, or the first one it has not been delivered yet): acked data goes,
  unacked data stays, and Redis memory stays bounded by the backlog.
- `publish` waits while the stream holds more than `high_water` entries not yet acked
  (backpressure), so a fast producer cannot fill Redis.
- A publish adds its entry once, however often it is retried: each message gets a random token and is
  added by one Lua script that returns the id held at `<stream>:sent:<token>` if there is one, else adds
  the entry and stores its id there (expiring 15 s after the retry budget); a retry whose first try reached
  Redis but whose reply was lost (a restart mid-call) gets the first try's entry id back, not a second entry.
- Connection loss is retried with backoff; past the deadline it is one RedisUnavailable error
  naming the URL (password redacted). An actor's first connect (`RunStreams.open`) has the same
  budget as a reconnect mid-run.
- This module is the only way to Redis outside queues/: an actor opens a `RunStreams` (one run's
  connection) and reads and writes through its `Stream`s and `StageHash`es, each named by its spec
  in queues.topology (the one declaration of the run's streams); `ping`, `ping_blocking` and
  `purge_run` serve the launcher and the preflight probe.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from queues.errors import redact  # noqa: F401 - re-exported: queues.streams.redact
from queues.topology import HashSpec, StreamSpec, run_key

T = TypeVar("T")


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (or refused our credentials) within the retry budget."""


stream_key = run_key  # arl:<run>:<name> (queues.topology)


async def connect(url: str, *, timeout_s: float = 10.0, password: str | None = None) -> aioredis.Redis:
    """A client for `url` that has answered PING; RedisUnavailable if it does not in time."""
    try:
        client = aioredis.Redis.from_url(
            url, password=password, socket_connect_timeout=2.0, socket_timeout=None,
            health_check_interval=15, retry_on_timeout=True,
        )
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {redact(url)!r}: {e}") from None
    client._arl_url = redact(url)  # for error messages elsewhere
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            await client.ping()
            return client
        except AuthenticationError as e:
            await client.aclose()
            raise RedisUnavailable(f"Redis at {redact(url)} refused the credentials: {e}") from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            if time.monotonic() + delay > deadline:
                await client.aclose()
                raise RedisUnavailable(f"cannot reach Redis at {redact(url)} after {timeout_s:.0f}s: {e}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        except ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                await client.aclose()
                raise RedisUnavailable(f"Redis at {redact(url)} needs a password (put it in REDIS_URL)") from None
            raise


async def with_retry(redis: aioredis.Redis, op: Callable[[], Awaitable[T]], *, budget_s: float = 30.0) -> T:
    """Runs `op`, retrying connection errors with backoff (e.g. while Redis restarts)."""
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while True:
        try:
            return await op()
        except (RedisConnectionError, RedisTimeoutError, ConnectionResetError, BrokenPipeError) as e:
            if time.monotonic() + delay > deadline:
                url = getattr(redis, "_arl_url", "?")
                raise RedisUnavailable(f"lost Redis at {url} for {budget_s:.0f}s: {e}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


# KEYS: the stream, its claim key for this message; ARGV: the data, the claim's lifetime (s).
# The claim holds the entry id, so a retry of a publish that did reach Redis returns that id.
_ADD_ONCE = """
local id = redis.call('GET', KEYS[2])
if id then return id end
id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])
redis.call('SET', KEYS[2], id, 'EX', ARGV[2])
return id
"""


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


class Stream:
    """Publish to and consume from `arl:<run>:<stage>` in consumer group `group`. `stage` is a stream
    of the run's topology (its group the spec's unless given) or, for a stream of no stage (tests,
    benchmarks), a bare name (its group that name unless given)."""

    def __init__(self, redis: aioredis.Redis, run_id: str, stage: StreamSpec | str, group: str | None = None, *,
                 high_water: int = 4096, trim_every: int = 32, retry_budget_s: float = 30.0):
        if isinstance(stage, StreamSpec):
            stage, group = stage.name, group or stage.group
        self.redis = redis
        self.key = stream_key(run_id, stage)
        self.stage = stage
        self.group = group or stage
        self.high_water = high_water
        self.trim_every = trim_every
        self.retry_budget_s = retry_budget_s
        self._acks_since_trim = 0
        self._add_once_script = None
        self._claim_s = int(retry_budget_s) + 15  # outlives every retry of the publish that made it (~0.3 kB each)

    def _add_once(self, *, keys: list[str], args: list, client=None):
        if self._add_once_script is None:
            self._add_once_script = self.redis.register_script(_ADD_ONCE)
        return self._add_once_script(keys=keys, args=args, client=client)

    def _claim_key(self) -> str:
        return f"{self.key}:sent:{os.urandom(12).hex()}"

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        return await with_retry(self.redis, op, budget_s=self.retry_budget_s)

    async def ensure_group(self) -> None:
        """Creates the stream and the group (reading from the start) if they do not exist."""
        async def create():
            try:
                await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        await self._call(create)

    # -- producing ---------------------------------------------------------------------------

    async def publish(self, data: bytes, *, wait: bool = True, max_wait_s: float | None = None) -> str:
        """XADD one message; first waits while the backlog is above high-water."""
        if wait and self.high_water > 0:
            waited = 0.0
            delay = 0.005
            while await self.backlog() >= self.high_water:
                if max_wait_s is not None and waited >= max_wait_s:
                    raise TimeoutError(f"{self.key}: backlog stayed above {self.high_water} for {max_wait_s}s")
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 0.2)
        claim = self._claim_key()
        entry_id = await self._call(lambda: self._add_once(keys=[self.key, claim], args=[data, self._claim_s]))
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    async def publish_many(self, items: list[bytes]) -> list[str]:
        """One round trip for many messages (the coordinator's prompts); no backpressure; each added once
        however often the round trip is retried."""
        claims = [self._claim_key() for _ in items]

        async def op():
            pipe = self.redis.pipeline(transaction=False)
            for data, claim in zip(items, claims):
                await self._add_once(keys=[self.key, claim], args=[data, self._claim_s], client=pipe)  # queued
            return await pipe.execute()
        ids = await self._call(op)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    # -- consuming ---------------------------------------------------------------------------

    @staticmethod
    def _entries(raw) -> list[tuple[str, bytes]]:
        out = []
        for entry_id, fields in raw:
            if fields is None:  # deleted while pending (trimmed): nothing to deliver
                continue
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            out.append((eid, fields.get(b"d") or fields.get("d")))
        return out

    async def consume(self, consumer: str, count: int = 8, block_ms: int = 1000) -> list[tuple[str, bytes]]:
        """New messages for `consumer` (they become pending on it until acked)."""
        async def op():
            try:
                return await self.redis.xreadgroup(self.group, consumer, {self.key: ">"}, count=count, block=block_ms)
            except ResponseError as e:
                if "NOGROUP" in str(e):  # stream or group vanished (e.g. Redis restarted without AOF)
                    await self.ensure_group()
                    return []
                raise
        res = await self._call(op)
        if not res:
            return []
        return self._entries(res[0][1])

    async def pending_mine(self, consumer: str, count: int = 100) -> list[tuple[str, bytes]]:
        """Messages already delivered to `consumer` but not acked (after a restart of it), oldest first."""
        res = await self._call(lambda: self.redis.xreadgroup(self.group, consumer, {self.key: "0"}, count=count))
        if not res:
            return []
        return self._entries(res[0][1])

    async def pending_all(self, consumer: str, page: int = 256) -> list[tuple[str, bytes]]:
        """Every message delivered to `consumer` and not acked, oldest first (read in pages)."""
        out: list[tuple[str, bytes]] = []
        after = "0"
        while True:
            start = after
            res = await self._call(lambda: self.redis.xreadgroup(self.group, consumer, {self.key: start}, count=page))
            raw = res[0][1] if res else []
            out += self._entries(raw)
            if len(raw) < page:
                return out
            last = raw[-1][0]
            after = last.decode() if isinstance(last, bytes) else last

    async def ack(self, ids: list[str]) -> None:
        if not ids:
            return
        await self._call(lambda: self.redis.xack(self.key, self.group, *ids))
        self._acks_since_trim += len(ids)
        if self._acks_since_trim >= self.trim_every:
            self._acks_since_trim = 0
            await self.trim()

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 16) -> list[tuple[str, bytes]]:
        """Takes over messages idle on any consumer for `min_idle_ms` (a dead one's)."""
        async def op():
            try:
                return await self.redis.xautoclaim(self.key, self.group, consumer, min_idle_ms, "0-0", count=count)
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    await self.ensure_group()
                    return [b"0-0", []]
                raise
        res = await self._call(op)
        return self._entries(res[1])

    async def touch(self, consumer: str, ids: list[str]) -> None:
        """Resets the idle time of `ids` pending on `consumer` (XCLAIM to itself): a heartbeat."""
        if ids:
            await self._call(lambda: self.redis.xclaim(self.key, self.group, consumer, 0, ids, justid=True))

    # -- bookkeeping -------------------------------------------------------------------------

    async def trim(self) -> int:
        """Drops entries every group has acked; returns how many were removed."""
        groups = await self._call(lambda: self.redis.xinfo_groups(self.key))
        if not groups:
            return 0
        needed: list[tuple[int, int]] = []
        for g in groups:
            name = g["name"]
            pending = await self._call(lambda: self.redis.xpending(self.key, name))
            if pending["pending"]:
                needed.append(_id_tuple(pending["min"]))
            else:
                ms, seq = _id_tuple(g["last-delivered-id"])
                needed.append((ms, seq + 1))
        ms, seq = min(needed)
        return await self._call(lambda: self.redis.xtrim(self.key, minid=f"{ms}-{seq}", approximate=False))

    async def backlog(self) -> int:
        """Entries still held (not yet acked by every group, or not yet trimmed)."""
        return int(await self._call(lambda: self.redis.xlen(self.key)))

    async def depth(self) -> dict[str, int]:
        """length (held entries), pending (delivered, unacked) and lag (not yet delivered)."""
        length = await self.backlog()
        try:
            groups = await self._call(lambda: self.redis.xinfo_groups(self.key))
        except ResponseError:
            groups = []
        mine = next((g for g in groups if (g["name"].decode() if isinstance(g["name"], bytes) else g["name"]) == self.group), None)
        pending = int(mine["pending"]) if mine else 0
        lag = mine.get("lag") if mine else None
        if lag is None and mine:  # Redis < 7 has no lag field: count the entries after the last delivered
            last = mine.get("last-delivered-id")
            last = last.decode() if isinstance(last, bytes) else last
            try:
                lag = len(await self._call(lambda: self.redis.xrange(self.key, min=f"({last}", max="+")))
            except ResponseError:  # before 6.2 (no exclusive ranges): held minus pending, an upper bound
                lag = max(0, length - pending)
        elif lag is None:
            lag = length
        return {"length": length, "pending": pending, "lag": int(lag)}

    async def delete(self) -> None:
        await self._call(lambda: self.redis.delete(self.key))


class RunStreams:
    """One run's connection to Redis: makes its Streams and StageHashes, and closes them all.

    What an actor holds instead of a client: outside queues/ nothing calls Redis but through these."""

    def __init__(self, redis: aioredis.Redis, run_id: str):
        self.redis = redis
        self.run_id = run_id

    @classmethod
    async def open(cls, url: str, run_id: str, *, timeout_s: float = 30.0) -> "RunStreams":
        """An actor's connection: the same 30 s budget as a connection lost mid-run (`with_retry`), so an
        actor Ray restarts while Redis restarts or the host is saturated waits as long as a live one would
        (the hour's soak saw a restarted generator miss a 10 s connect at load ~130 and end the run)."""
        return cls(await connect(url, timeout_s=timeout_s), run_id)

    def stream(self, spec: StreamSpec, **kwargs) -> "Stream":
        """The run's stream `spec` (queues.topology), in its consumer group."""
        if not isinstance(spec, StreamSpec):
            raise TypeError(f"RunStreams.stream takes a queues.topology spec (e.g. PROMPTS), got {spec!r}")
        return Stream(self.redis, self.run_id, spec, **kwargs)

    def hash(self, spec: HashSpec) -> "StageHash":
        if not isinstance(spec, HashSpec):
            raise TypeError(f"RunStreams.hash takes a queues.topology spec (e.g. ASSEMBLED), got {spec!r}")
        return StageHash(self.redis, self.run_id, spec.name)

    async def close(self) -> None:
        await self.redis.aclose()


async def ping(url: str, timeout_s: float = 5.0) -> None:
    """Returns once Redis at `url` answers PING (and takes our credentials); RedisUnavailable if not in time."""
    client = await connect(url, timeout_s=timeout_s)
    await client.aclose()


def ping_blocking(url: str, timeout_s: float) -> None:
    """`ping` without an event loop (the preflight probe's synchronous report); raises what redis-py raises."""
    import redis as sync_redis

    client = sync_redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    finally:
        client.close()


async def purge_run(url: str, run_id: str) -> int:
    """Deletes every key of run `run_id` (`arl:<run>:*`: its streams and hashes); returns how many."""
    client = await connect(url)
    try:
        keys = [k async for k in client.scan_iter(match=stream_key(run_id, "*"))]
        return int(await with_retry(client, lambda: client.delete(*keys))) if keys else 0
    finally:
        await client.aclose()


class StageHash:
    """A run-scoped Redis hash (`arl:<run>:<name>`) over the same client and retries as a Stream.

    Used for small durable memos (the assembler's per-task outcomes) that must survive an actor
    restart; values are bytes, fields strings.
    """

    def __init__(self, redis: aioredis.Redis, run_id: str, name: str, *, retry_budget_s: float = 30.0):
        self.redis = redis
        self.key = stream_key(run_id, name)
        self.retry_budget_s = retry_budget_s

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        return await with_retry(self.redis, op, budget_s=self.retry_budget_s)

    async def get(self, field: str) -> bytes | None:
        return await self._call(lambda: self.redis.hget(self.key, field))

    async def put(self, field: str, value: bytes) -> None:
        await self._call(lambda: self.redis.hset(self.key, field, value))

    async def values(self) -> list[bytes]:
        return list(await self._call(lambda: self.redis.hvals(self.key)) or [])

    async def fields(self) -> list[str]:
        raw = await self._call(lambda: self.redis.hkeys(self.key)) or []
        return [f.decode() if isinstance(f, bytes) else f for f in raw]

    async def delete(self, *fields: str) -> None:
        if fields:
            await self._call(lambda: self.redis.hdel(self.key, *fields))
