"""SimulatedEngine: labelled as simulated everywhere, lognormal lengths, groups return independently."""
import asyncio
import statistics

from actors.engines.simulated import SimulatedEngine
from config import GeneratorConfig
from queues.messages import PromptTask, pack_ids, unpack_ids


def task(i, n=4, **sampling):
    return PromptTask(task_id=str(i), prompt_id=str(i), step=0, policy_version=0, prompt_tokens=pack_ids([1, 2, 3]),
                      n=n, sampling=sampling)


async def test_simulated_output_says_it_is_simulated_and_lengths_are_lognormal_around_the_mean():
    engine = SimulatedEngine(GeneratorConfig(engine="simulated", max_tokens=4096), mean_response_tokens=300,
                             tick_s=0.0, per_seq_s=0.0)
    groups = await asyncio.gather(*[engine.generate(task(i)) for i in range(50)])
    lengths = [len(unpack_ids(s.tokens)) for g in groups for s in g.samples]
    assert all(s.text.startswith("[simulated]") for g in groups for s in g.samples)
    assert engine.stats()["simulated"] == 1.0
    assert 240 < statistics.mean(lengths) < 360
    assert max(lengths) > 2 * statistics.median(lengths), "no long tail"


async def test_simulated_short_group_returns_before_a_long_one():
    engine = SimulatedEngine(GeneratorConfig(engine="simulated", max_tokens=4096), mean_response_tokens=2000,
                             sigma=0.01, tick_s=0.0005)
    long = asyncio.ensure_future(engine.generate(task(0, n=1)))
    short = await engine.generate(task(1, n=1, max_tokens=5))
    assert not long.done() and short.samples[0].finish_reason == "length"
    long.cancel()
