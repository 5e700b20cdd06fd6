"""actors/coordinator/generated.py without a stream: the record, its bounded wait and its forgetting."""
import asyncio
import time

from actors.coordinator.generated import GeneratedEvents
from queues.messages import eval_task_id, train_task_id


async def test_a_wait_ends_when_the_last_task_is_recorded_and_returns_when_it_was_generated():
    rec, ids = GeneratedEvents(), [train_task_id(0, k) for k in range(3)]
    rec.record(ids[0], 1.0)

    async def later():
        await asyncio.sleep(0.1)
        rec.record(ids[1], 2.0)
        rec.record(ids[2], 3.0)

    async def tick():
        raise AssertionError("no tick within the first second")

    t0 = time.monotonic()
    _, last = await asyncio.gather(later(), rec.wait(ids, 5.0, tick))
    assert last == 3.0 and rec.missing(ids) == 0 and time.monotonic() - t0 < 1.0


async def test_a_wait_is_bounded_and_ticks_about_once_a_second_meanwhile():
    rec, ticks = GeneratedEvents(), []

    async def tick():
        ticks.append(time.monotonic())

    t0 = time.monotonic()
    await rec.wait([train_task_id(0, 0)], 2.5, tick)
    assert 2.4 < time.monotonic() - t0 < 3.5 and len(ticks) == 2 and rec.missing([train_task_id(0, 0)]) == 1


def test_forget_drops_earlier_steps_evaluations_included():
    rec = GeneratedEvents()
    for t in (train_task_id(1, 0), eval_task_id(1, "g", 0), train_task_id(2, 0), eval_task_id(2, "s", 0)):
        rec.record(t, 0.0)
    rec.forget(2)
    assert set(rec.done) == {train_task_id(2, 0), eval_task_id(2, "s", 0)}
