"""The stages' stream consumers on the one consumer loop (queues/worker.py), over a real redis-server:
the coordinator's events consumer and the assembler's handling of a message it cannot decode."""
import asyncio
import time

import pytest

from actors.assembler import FAILED, TRAINED, Assembler
from actors.coordinator.coordinator import Coordinator
from config import AssemblerConfig, RunContext, apply_overrides
from config.recipes import get_recipe
from queues.messages import Event, SchemaError, ScoredGroup, codec
from queues.streams import RunStreams
from queues.topology import EVENTS, SCORED
from queues.worker import Worker
from tests.builders import scored


async def test_the_coordinator_s_events_consumer_records_acks_and_surfaces_its_failure(redis_url, tmp_path):
    coord = Coordinator(apply_overrides(get_recipe("tiny"), []), RunContext(run_id="ev", redis_url=redis_url), [], [],
                        generators=[], learner=None, assembler=None)
    await coord.connect()
    assert isinstance(coord.generated.worker, Worker)
    producer = await RunStreams.open(redis_url, "ev")
    events = producer.stream(EVENTS, high_water=0)
    enc = codec(Event).encode
    for t in ("0:0:0", "0:1:0"):
        await events.publish(enc(Event(kind="generated", source="generator-0", task_id=t, at=time.time())))
    await events.publish(enc(Event(kind="metrics", source="scorer-0")))  # other kinds: acked, not recorded
    await coord._wait_generated(["0:0:0", "0:1:0"], timeout_s=20)
    assert set(coord.generated.done) == {"0:0:0", "0:1:0"}
    for _ in range(100):  # the third is acked right after it is handled
        if (await coord.events.depth())["pending"] == 0:
            break
        await asyncio.sleep(0.05)
    assert (await coord.events.depth())["pending"] == 0
    await events.publish(b"not an event")  # a broken producer: the wait ends with the consumer's error
    with pytest.raises(SchemaError):
        await coord._wait_generated(["0:2:0"], timeout_s=20)
    assert (await coord.events.depth())["pending"] == 1  # left pending, never acked
    await coord.disconnect()
    await producer.close()


async def test_the_assembler_acks_and_counts_an_undecodable_group_and_keeps_consuming(redis_url):
    """Its consume loop used to die on one (an unretrieved task exception): every later step waited out
    its deadline. Now the message is acked and counted, its task ends "failed", the rest is assembled."""
    producer = await RunStreams.open(redis_url, "u")
    stream = producer.stream(SCORED)
    await stream.ensure_group()
    asm = Assembler(AssemblerConfig(), RunContext(run_id="u", redis_url=redis_url))
    await asm.start()
    await stream.publish(b"garbage")
    await stream.publish(codec(ScoredGroup).encode(scored("0:0:0", [1.0, 0.0])))
    result = await asm.collect(0, ["0:0:0", "0:1:0"], version=0, timeout_s=2.0)
    assert result["outcomes"] == {"0:0:0": TRAINED, "0:1:0": FAILED}
    assert asm.stats()["undecodable"] == 1.0 and (await stream.depth())["pending"] == 0
    await asm.stop()
    await producer.close()
