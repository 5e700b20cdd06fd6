"""The async-mode sweep: samples trained per second and generator idle time, colocated vs async.

    .venv/bin/python -m bench.cpu.async_modes [--prompts 64] [--samples 16] [--steps 5] [--modes ...]

What runs (one process, one asyncio loop, plus an embedded redis-server):
  coordinator  actors.coordinator.coordinator.Coordinator, the real step loop (run(): publish-ahead, handshakes,
               the async boundary with or without partial rollouts); checkpoints are skipped
  generator    actors.generator.generator.Generator over actors.engines.simulated.SimulatedEngine: a latency
               model of one batching engine (every live sequence decodes one token per tick of
               `tick_s + per_seq_s * live` s), response lengths lognormal with a long tail
               (p99/p50 >= 4, checked and printed), interrupt/continue for partial rollouts
  scorer       a stand-in: reads the real rollouts stream, publishes ScoredGroups with seeded
               random 0/1 rewards (scoring cost is bench/cpu/overlap.py's subject, not this one's)
  assembler    actors.assembler.Assembler, the real one (admission by oldest token, packing)
  learner      a latency model: reads its TrainBatch off the real batches stream and sleeps
               `train_s_per_ktok` per 1,000 trained tokens; sleep/wake and the weight sync
               sleep fixed times (colocated pays sleep + wake every step, both modes pay the sync)
Measured over steps 2..N (the first step fills the pipeline): samples trained per second, and
the generator's idle fraction (no sequence decoding; sampled every 5 ms, time-weighted), plus the staleness and
interruption metrics the coordinator logs. Every number is a latency model's: the ratios between
modes are what the bench is for, not the absolute times.
"""
from __future__ import annotations

import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

from actors.assembler import Assembler  # noqa: E402
from actors.coordinator.coordinator import Coordinator  # noqa: E402
from actors.engines.simulated import SimulatedEngine  # noqa: E402
from actors.generator.generator import Generator  # noqa: E402
from config import RunConfig, RunContext, apply_overrides  # noqa: E402
from queues.messages import RolloutGroup, ScoredGroup, TrainBatch, codec, pack_ids  # noqa: E402
from queues.redis_server import EmbeddedRedis  # noqa: E402
from queues.streams import Stream, connect  # noqa: E402
from queues.topology import BATCHES, ROLLOUTS, SCORED  # noqa: E402
from weights.bucketed import Next, Start  # noqa: E402
from weights.wire import SyncSummary  # noqa: E402

MODES = {  # name -> config overrides
    "colocated": ["coordinator.mode=colocated", "assembler.max_staleness=0"],
    "async_s1": ["coordinator.mode=async", "assembler.max_staleness=1", "generator.partial_rollouts=false"],
    "async_s2": ["coordinator.mode=async", "assembler.max_staleness=2", "generator.partial_rollouts=false"],
    "async_s1_partial": ["coordinator.mode=async", "assembler.max_staleness=1", "generator.partial_rollouts=true"],
    "async_s2_partial": ["coordinator.mode=async", "assembler.max_staleness=2", "generator.partial_rollouts=true"],
}


@dataclass
class Settings:
    prompts: int = 64
    samples: int = 16
    steps: int = 5
    mean_response_tokens: float = 100.0
    sigma: float = 0.75  # lognormal: p99/p50 = exp(2.326 sigma) = 5.7
    max_tokens: int = 2048
    tick_s: float = 0.01
    per_seq_s: float = 5e-6
    prompt_tokens: int = 200
    train_s_per_ktok: float = 0.025  # learner latency model
    sync_s: float = 0.5
    sleep_wake_s: float = 1.0  # colocated: engine sleep + learner wake, and again learner sleep + engine wake
    seed: int = 0


@dataclass
class Item:  # what Coordinator._tasks reads from a training item
    prompt_id: str
    prompt_tokens: bytes
    db_id: str = ""
    db_path: str = ""
    gold_sql: str = ""
    difficulty: str = ""


class SimLearner:
    """The learner's calls the coordinator makes, as latencies; training reads the real batch."""

    def __init__(self, redis, run_id: str, s: Settings):
        self.batches = Stream(redis, run_id, BATCHES)
        self.s = s
        self._version = 0

    async def wake(self):
        await asyncio.sleep(self.s.sleep_wake_s / 2)

    async def sleep(self):
        await asyncio.sleep(self.s.sleep_wake_s / 2)

    async def train_from_stream(self, step: int) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for eid, data in await self.batches.consume("learner-0", count=1, block_ms=100):
                batch = codec(TrainBatch).decode(data)
                await self.batches.ack([eid])
                if batch.step != step:
                    continue
                await asyncio.sleep(self.s.train_s_per_ktok * batch.num_tokens / 1000)
                return {"tokens": float(batch.num_tokens)}
        raise TimeoutError(f"no TrainBatch for step {step}")

    async def send_weights(self, call):
        """The object store's sender steps (start / next / abort): one summary after `sync_s`."""
        if isinstance(call.step, Start):
            self._version = call.step.version
        elif isinstance(call.step, Next):
            await asyncio.sleep(self.s.sync_s)
            return SyncSummary(version=self._version, num_buckets=1, num_tensors=0, nbytes=0)
        return None


class SimGenerator(Generator):
    """The real Generator; a sync's summary is the whole of a weight update here."""

    async def receive_weights(self, call):
        message = call.step.message  # weights.bucketed.Receive
        if isinstance(message, SyncSummary):
            await self.finish_weight_update(message.version)
            return message.version
        return None


async def stand_in_scorer(redis, run_id: str, seed: int) -> None:
    rollouts = Stream(redis, run_id, ROLLOUTS)
    scored = Stream(redis, run_id, SCORED)
    await rollouts.ensure_group()
    while True:
        for eid, data in await rollouts.consume("scorer-0", count=64, block_ms=50):
            g = codec(RolloutGroup).decode(data)
            rng = random.Random(f"{seed}:{g.task.task_id}")
            rewards = [float(rng.random() < 0.5) for _ in g.samples]
            await scored.publish(codec(ScoredGroup).encode(ScoredGroup(
                rollout=g, rewards=rewards, verdicts=["match" if r else "wrong_result" for r in rewards])))
            await rollouts.ack([eid])


class StepClock:
    """metrics_logger stand-in: the time each step ended and its metrics."""

    def __init__(self):
        self.rows: list[tuple[float, dict]] = []

    def log_step(self, step: int, m: dict) -> None:
        self.rows.append((time.perf_counter(), dict(m)))

    def close(self) -> None:
        pass


async def idle_sampler(engine: SimulatedEngine, samples: list[tuple[float, bool]]) -> None:
    while True:
        samples.append((time.perf_counter(), engine._live == 0))
        await asyncio.sleep(0.005)


async def run_mode(name: str, s: Settings, redis_url: str) -> dict:
    run_id = f"modes-{name}-{uuid.uuid4().hex[:6]}"
    cfg = apply_overrides(RunConfig(), [
        "generator.engine=transformers", f"generator.n_samples={s.samples}", f"generator.max_tokens={s.max_tokens}",
        f"generator.max_inflight_prompts={4 * s.prompts}", f"coordinator.prompts_per_step={s.prompts}",
        f"coordinator.steps={s.steps}", "coordinator.weight_sync=object_store", "coordinator.eval_every=0",
        "assembler.filter_zero_variance=false", "assembler.micro_batch_tokens=1000000", *MODES[name]])
    cfg.generator.engine = "simulated"  # after validation: a training config refuses it, this is a bench
    engine = SimulatedEngine(cfg.generator, mean_response_tokens=s.mean_response_tokens, sigma=s.sigma,
                             tick_s=s.tick_s, per_seq_s=s.per_seq_s, max_concurrent_seqs=s.prompts * s.samples * 4,
                             seed=s.seed)
    gen = SimGenerator(engine, cfg.generator, consume_block_ms=20)
    redis = await connect(redis_url)
    ctx = RunContext.of(cfg, run_id, tempfile.mkdtemp(prefix="arl-modes-"), redis_url)
    assembler = Assembler(cfg.assembler, ctx, consumer="assembler-0")
    await assembler.start()
    learner = SimLearner(redis, run_id, s)
    await learner.batches.ensure_group()
    clock = StepClock()
    items = [Item(prompt_id=f"q{i}", prompt_tokens=pack_ids([1 + i % 50] * s.prompt_tokens)) for i in range(s.prompts * (s.steps + 2))]
    coord = Coordinator(cfg, ctx, items, [], generators=[gen], learner=learner, assembler=assembler, metrics_logger=clock)
    coord.save_checkpoint = lambda step: asyncio.sleep(0)  # no learner state to save here
    idle: list[tuple[float, bool]] = []
    tasks = [asyncio.create_task(gen.run(redis_url, run_id, "gen-0")),
             asyncio.create_task(stand_in_scorer(redis, run_id, s.seed)),
             asyncio.create_task(idle_sampler(engine, idle))]
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(coord.run(), timeout=600)
    finally:
        gen.stop()
        for t in tasks[1:] + [assembler._task]:
            t.cancel()
        await asyncio.wait(tasks + [assembler._task], timeout=30)
        await redis.aclose()
    start, end = clock.rows[0][0], clock.rows[-1][0]  # steps 2..N: from the end of step 1
    rows = [m for _, m in clock.rows[1:]]
    trained = sum(m.get("prompts_trained", 0.0) for m in rows) * s.samples
    # Time-weighted: each sample holds until the next one (a busy loop wakes the sampler late,
    # so unweighted samples would over-count the idle stretches, when it wakes on time).
    spans = [(t1 - t0, i0) for (t0, i0), (t1, _) in zip(idle, idle[1:]) if start <= t0 and t1 <= end]
    return {
        "mode": name, "samples_per_s": trained / (end - start), "step_s": (end - start) / len(rows),
        "generator_idle_frac": sum(d for d, i in spans if i) / max(1e-9, sum(d for d, _ in spans)),
        "wall_s": time.perf_counter() - t0,
        "staleness_mean": statistics.mean(m.get("staleness_mean", 0.0) for m in rows),
        "staleness_max": max(m.get("staleness_max", 0.0) for m in rows),
        "partial_samples_frac": statistics.mean(m.get("partial_samples_frac", 0.0) for m in rows),
        "interrupted_requests": sum(m.get("interrupted_requests", 0.0) for m in rows),
        "time_generator_pause_s": statistics.mean(m.get("time_generator_pause", 0.0) for m in rows),
        "prompts_stale": sum(m.get("prompts_stale", 0.0) for m in rows),
        "accounting_holds": all(m["prompts"] == sum(m.get(f"prompts_{o}", 0.0) for o in
                                                      ("trained", "filtered", "stale", "gold_failed", "failed"))
                                for _, m in clock.rows),
    }


def tail_ratio(s: Settings) -> tuple[float, float, float]:
    """(p50, p99, p99/p50) of the response-length model, from 20,000 draws."""
    e = SimulatedEngine(None, mean_response_tokens=s.mean_response_tokens, sigma=s.sigma, seed=s.seed + 1)
    lengths = sorted(e.response_length(s.max_tokens) for _ in range(20_000))
    p50, p99 = lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.99)]
    return p50, p99, p99 / p50


async def main_async(s: Settings, modes: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="arl-modes-redis-") as tmp, EmbeddedRedis(tmp) as r:
        return [await run_mode(m, s, r.url) for m in modes]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, v in asdict(Settings()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    s = Settings(**{f: getattr(args, f) for f in asdict(Settings())})
    p50, p99, ratio = tail_ratio(s)
    print(f"response lengths: p50 {p50}, p99 {p99} tokens (p99/p50 {ratio:.1f}); "
          f"{s.prompts} prompts x {s.samples} samples, {s.steps} steps")
    results = asyncio.run(main_async(s, args.modes))
    base = next((r["samples_per_s"] for r in results if r["mode"] == "colocated"), math.nan)
    print(f"{'mode':<18} {'samples/s':>9} {'x coloc':>7} {'step s':>7} {'gen idle':>8} {'stale':>5} "
          f"{'partial':>7} {'interr.':>7} {'pause s':>7}")
    for r in results:
        print(f"{r['mode']:<18} {r['samples_per_s']:9.1f} {r['samples_per_s'] / base:7.2f} {r['step_s']:7.2f} "
              f"{r['generator_idle_frac']:8.1%} {r['staleness_mean']:5.2f} {r['partial_samples_frac']:7.1%} "
              f"{r['interrupted_requests']:7.0f} {r['time_generator_pause_s']:7.2f}"
              + ("" if r["accounting_holds"] else "  ACCOUNTING BROKEN"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": asdict(s), "tail": [p50, p99, ratio], "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
