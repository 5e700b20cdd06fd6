"""queues/worker.py over a real redis-server: pending first, reclaim, heartbeat, ack after publish, stop."""
import asyncio

import pytest

from queues.streams import Stream, connect
from queues.topology import ROLLOUTS
from queues.worker import Worker


async def _stream(url: str, run: str = "w") -> tuple:
    redis = await connect(url)
    s = Stream(redis, run, ROLLOUTS, "g")
    await s.ensure_group()
    return redis, s


async def _pending(redis, s: Stream) -> dict[str, int]:
    rows = await redis.xpending_range(s.key, s.group, min="-", max="+", count=100)
    return {r["message_id"].decode(): r["consumer"].decode() for r in rows}


async def _until(cond, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_pending_first_after_restart(redis_url):
    redis, s = await _stream(redis_url)
    old = [await s.publish(f"old{i}".encode()) for i in range(2)]
    assert len(await s.consume("c1", count=2)) == 2  # c1 held these when it "died"
    await s.publish(b"new")
    seen = []

    async def handle(eid, data):
        seen.append(data)

    w = Worker(s, "c1", handle, concurrency=1, reclaim_idle_s=60)
    task = asyncio.create_task(w.run())
    await _until(lambda: asyncio.sleep(0, len(seen) == 3))
    w.stop()
    await asyncio.wait_for(task, 5)
    assert seen == [b"old0", b"old1", b"new"]
    assert await _pending(redis, s) == {}
    assert old  # ids existed
    await redis.aclose()


async def test_reclaims_a_dead_consumers_entries(redis_url):
    redis, s = await _stream(redis_url)
    eid = await s.publish(b"orphan")
    assert [e for e, _ in await s.consume("dead", count=1)] == [eid]
    seen = []

    async def handle(e, data):
        seen.append(e)

    w = Worker(s, "live", handle, reclaim_idle_s=0.3)
    task = asyncio.create_task(w.run())
    await _until(lambda: asyncio.sleep(0, seen == [eid]))
    w.stop()
    await asyncio.wait_for(task, 5)
    assert w.reclaimed == 1
    assert await _pending(redis, s) == {}
    await redis.aclose()


async def test_heartbeat_keeps_a_slow_entry_from_being_stolen(redis_url):
    redis, s = await _stream(redis_url)
    eid = await s.publish(b"slow")
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(e, data):
        started.set()
        await release.wait()

    stolen = []

    async def thief_handle(e, data):
        stolen.append(e)

    owner = Worker(s, "owner", slow, reclaim_idle_s=0.4)
    t1 = asyncio.create_task(owner.run())
    await asyncio.wait_for(started.wait(), 10)
    thief = Worker(s, "thief", thief_handle, reclaim_idle_s=0.4)
    t2 = asyncio.create_task(thief.run())
    # Many reclaim rounds of the thief (every 0.5 s) while the entry stays in flight on its owner,
    # each one past the 0.4 s idle bound were it not for the heartbeat.
    for _ in range(6):
        await asyncio.sleep(0.5)
        assert await _pending(redis, s) == {eid: "owner"}
    release.set()
    await _until(lambda: _empty(redis, s))
    owner.stop(), thief.stop()
    await asyncio.wait_for(asyncio.gather(t1, t2), 5)
    assert stolen == [] and thief.reclaimed == 0
    await redis.aclose()


async def _empty(redis, s):
    return await _pending(redis, s) == {}


async def test_no_ack_before_publish_a_raising_handler_leaves_it_pending(redis_url):
    redis, s = await _stream(redis_url)
    eid = await s.publish(b"bad")

    async def fails(e, data):
        raise RuntimeError("could not publish")

    w = Worker(s, "c1", fails, reclaim_idle_s=60, on_error="raise")
    with pytest.raises(RuntimeError, match="could not publish"):
        await asyncio.wait_for(w.run(), 10)
    assert await _pending(redis, s) == {eid: "c1"}

    w2 = Worker(s, "c2", fails, reclaim_idle_s=60, on_error="leave")  # logs, keeps consuming
    eid2 = await s.publish(b"bad2")
    task = asyncio.create_task(w2.run())
    await _until(lambda: asyncio.sleep(0, w2.failed == 1))
    w2.stop()
    await asyncio.wait_for(task, 5)
    assert await _pending(redis, s) == {eid: "c1", eid2: "c2"}
    await redis.aclose()


async def test_stop_is_bounded_and_leaves_unfinished_entries_pending(redis_url):
    redis, s = await _stream(redis_url)
    eid = await s.publish(b"endless")
    started = asyncio.Event()

    async def endless(e, data):
        started.set()
        await asyncio.Event().wait()

    w = Worker(s, "c1", endless, reclaim_idle_s=60, block_ms=200, drain_s=0.2)
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(started.wait(), 10)
    w.stop()
    await asyncio.wait_for(task, 5)  # drain bound, then cancelled
    assert w.inflight == {}
    assert await _pending(redis, s) == {eid: "c1"}
    await redis.aclose()


async def test_pending_first_reads_every_held_entry_not_only_the_first_page(redis_url):
    """A restarted consumer that held more than one page of entries (the assembler holds a whole
    step's groups) gets all of them back before anything new."""
    redis, s = await _stream(redis_url)
    held = [await s.publish(f"h{i}".encode()) for i in range(300)]
    assert len(await s.consume("c1", count=300)) == 300
    await s.publish(b"new")
    assert [e for e, _ in await s.pending_all("c1", page=64)] == held
    seen = []

    async def handle(eid, data):
        seen.append(data)

    w = Worker(s, "c1", handle, concurrency=16, reclaim_idle_s=60)
    task = asyncio.create_task(w.run())
    await _until(lambda: asyncio.sleep(0, len(seen) == 301))
    w.stop()
    await asyncio.wait_for(task, 5)
    assert seen[-1] == b"new" and sorted(seen[:300]) == sorted(f"h{i}".encode() for i in range(300))
    await redis.aclose()


async def test_handler_acks_mode_never_acks_and_hands_held_entries_back_to_their_owner(redis_url):
    """acks="handler" (the assembler): returning is not publishing; the entries stay pending until the
    owner acks them, a reclaim hands them back to the handler, and no entry is acked by the worker."""
    redis, s = await _stream(redis_url)
    ids = [await s.publish(f"g{i}".encode()) for i in range(3)]
    seen: list[str] = []

    async def hold(eid, data):
        seen.append(eid)

    w = Worker(s, "asm", hold, reclaim_idle_s=0.3, heartbeat=False, acks="handler")
    task = asyncio.create_task(w.run())
    await _until(lambda: asyncio.sleep(0, len(seen) >= 3))
    await asyncio.sleep(1.2)  # past the idle bound and two reclaim rounds
    assert await _pending(redis, s) == {e: "asm" for e in ids}
    assert set(seen) == set(ids) and len(seen) > 3 and w.reclaimed >= 3  # handed back, not lost
    await s.ack(ids[:2])  # the owner publishes its output, then acks
    assert await _pending(redis, s) == {ids[2]: "asm"}
    w.stop()
    await asyncio.wait_for(task, 5)
    with pytest.raises(ValueError, match="acks"):
        Worker(s, "x", hold, acks="never")
    await redis.aclose()


async def test_take_offers_pending_first_skips_what_pick_passes_over_and_acks_nothing(redis_url):
    """Pull mode (the learner's batch for step s): own pending entries first, then new ones; an entry
    `pick` passes over stays pending and is offered again; the taken one stays pending until acked."""
    redis, s = await _stream(redis_url)
    w = Worker(s, "learner-0", reclaim_idle_s=60, block_ms=100, read_count=4)
    old = await s.publish(b"step0")
    later = await s.publish(b"step2")
    assert len(await s.consume("learner-0", count=2)) == 2  # held before a restart
    offered: list[bytes] = []

    async def want(step: bytes):
        async def pick(eid, data):
            offered.append(data)
            if data < step:  # already trained: discarded and acked by the caller's pick
                await s.ack([eid])
                return None
            return data if data == step else None
        return pick

    assert await w.take(await want(b"step1"), timeout_s=0.5) is None  # nothing for step 1 yet: bounded
    assert offered[:2] == [b"step0", b"step2"]
    assert await _pending(redis, s) == {later: "learner-0"}
    new = await s.publish(b"step1")
    got = await w.take(await want(b"step1"), timeout_s=10)
    assert got == (new, b"step1")
    assert await _pending(redis, s) == {later: "learner-0", new: "learner-0"}  # taken: pending until acked
    await s.ack([new])
    assert await w.take(await want(b"step2"), timeout_s=10) == (later, b"step2")  # passed over, offered again
    assert old not in await _pending(redis, s)
    with pytest.raises(ValueError, match="handler"):
        await w.run()
    await redis.aclose()


async def test_take_reclaims_a_dead_consumers_entry_on_the_one_cadence(redis_url):
    redis, s = await _stream(redis_url)
    eid = await s.publish(b"orphan")
    assert [e for e, _ in await s.consume("dead", count=1)] == [eid]

    async def pick(e, data):
        return data

    w = Worker(s, "live", reclaim_idle_s=0.3, block_ms=100)
    assert await w.take(pick, timeout_s=10) == (eid, b"orphan")
    assert w.reclaimed == 1 and await _pending(redis, s) == {eid: "live"}
    await redis.aclose()
