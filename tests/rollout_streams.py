"""The generator tests' streams: the prompts stream a generator reads and the rollouts stream it writes, on a
real Redis, and a bounded read of the groups it published.

Invariant: every wait is bounded (collect's timeout); the streams belong to run RUN.
"""
from __future__ import annotations

import time

from queues.messages import RolloutGroup, codec
from queues.streams import Stream, connect
from queues.topology import PROMPTS, ROLLOUTS

RUN = "gen-test"


async def streams(url):
    redis = await connect(url)
    prompts = Stream(redis, RUN, PROMPTS)
    rollouts = Stream(redis, RUN, ROLLOUTS)
    await prompts.ensure_group()
    await rollouts.ensure_group()
    return prompts, rollouts


async def collect(rollouts, count, timeout=30.0):
    """Reads `count` groups off the rollouts stream, stamping each with its arrival time."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} groups arrived"
        for eid, data in await rollouts.consume("scorer0", count=32, block_ms=50):
            got.append((time.time(), codec(RolloutGroup).decode(data)))
            await rollouts.ack([eid])
    return got
