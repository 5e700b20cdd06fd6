"""RolloutGroup-sized messages through publish -> consume -> ack on the embedded Redis.

    python -m bench.cpu.streams [--groups 2000] [--rate 200]

Prints groups/s and p50/p99 latency at a paced rate and flat out, and msgspec msgpack
against json and pickle for the same payload (encode+decode time and bytes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import tempfile
import time

import numpy as np

from queues.messages import PromptTask, RolloutGroup, Sample, codec, pack_floats, pack_ids
from queues.redis_server import EmbeddedRedis
from queues.streams import Stream, connect
from queues.topology import ROLLOUTS

N_SAMPLES, RESPONSE_TOKENS, PROMPT_TOKENS = 16, 1200, 3000


def make_group(i: int = 0) -> RolloutGroup:
    rng = np.random.default_rng(i)
    task = PromptTask(task_id=f"0:{i}:0", prompt_id=f"q{i}", step=0, policy_version=0, n=N_SAMPLES,
                      prompt_tokens=pack_ids(rng.integers(0, 151_936, PROMPT_TOKENS)), db_id="db",
                      db_path="/data/bird/train_databases/db/db.sqlite", gold_sql="SELECT 1")
    samples = [Sample(tokens=pack_ids(rng.integers(0, 151_936, RESPONSE_TOKENS)),
                      logprobs=pack_floats(-rng.random(RESPONSE_TOKENS)), finish_reason="stop",
                      text="x" * 3000) for _ in range(N_SAMPLES)]
    return RolloutGroup(task=task, samples=samples, policy_version=0)


def as_plain(group: RolloutGroup) -> dict:
    """What the message looks like without packed bytes: token ids and log-probs as lists."""
    t = group.task
    return {"task": {"task_id": t.task_id, "prompt_id": t.prompt_id, "prompt_tokens": np.frombuffer(t.prompt_tokens, "<i4").tolist()},
            "samples": [{"tokens": np.frombuffer(s.tokens, "<i4").tolist(),
                         "logprobs": np.frombuffer(s.logprobs, "<f4").tolist(), "text": s.text} for s in group.samples]}


def time_codec(name, encode, decode, payload, reps=20):
    data = encode(payload)
    start = time.perf_counter()
    for _ in range(reps):
        decode(encode(payload))
    return name, (time.perf_counter() - start) / reps * 1e3, len(data)


async def pump(url: str, groups: int, rate: float | None) -> dict:
    pub = Stream(await connect(url), "bench", ROLLOUTS, high_water=100_000, trim_every=64)
    sub = Stream(await connect(url), "bench", ROLLOUTS, trim_every=64)
    await pub.ensure_group()
    c = codec(RolloutGroup)
    payloads = [c.encode(make_group(i)) for i in range(16)]
    sent: dict[int, float] = {}
    latencies: list[float] = []

    async def producer():
        start = time.perf_counter()
        for i in range(groups):
            if rate:
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            sent[i] = time.perf_counter()
            await pub.publish(i.to_bytes(4, "little") + payloads[i % 16])

    async def consumer():
        got = 0
        while got < groups:
            for msg_id, data in await sub.consume("c0", count=32, block_ms=100):
                i = int.from_bytes(data[:4], "little")
                c.decode(data[4:])
                latencies.append(time.perf_counter() - sent[i])
                await sub.ack([msg_id])
                got += 1

    start = time.perf_counter()
    await asyncio.gather(producer(), consumer())
    elapsed = time.perf_counter() - start
    lat = sorted(latencies)
    return {"groups_s": groups / elapsed, "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3, "mb": len(payloads[0]) / 1e6,
            "backlog_after": await sub.backlog()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=200.0)
    args = ap.parse_args()
    group = make_group()
    c = codec(RolloutGroup)
    plain = as_plain(group)
    rows = [time_codec("msgspec msgpack (packed bytes)", c.encode, c.decode, group),
            time_codec("json (token lists)", lambda p: json.dumps(p).encode(), json.loads, plain),
            time_codec("pickle (token lists)", pickle.dumps, pickle.loads, plain)]
    print(f"payload: {N_SAMPLES} samples x {RESPONSE_TOKENS} tokens + a {PROMPT_TOKENS}-token prompt")
    print(f"{'codec':<32} {'enc+dec ms':>10} {'bytes':>10}")
    for name, ms, size in rows:
        print(f"{name:<32} {ms:>10.2f} {size:>10,}")
    print(f"msgspec speed-up: {rows[1][1] / rows[0][1]:.1f}x vs json, {rows[2][1] / rows[0][1]:.1f}x vs pickle")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp) as server:
        for label, rate in [(f"paced {args.rate:.0f}/s", args.rate), ("flat out", None)]:
            r = asyncio.run(pump(server.url, args.groups, rate))
            print(f"{label:<14} {r['groups_s']:>8.0f} groups/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms"
                  f"  ({r['mb']:.3f} MB/group, backlog after: {r['backlog_after']})")


if __name__ == "__main__":
    main()
