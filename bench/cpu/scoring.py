"""Scoring throughput: serial in-process vs the SqlPool, and what the gold cache and dedup save.

    .venv/bin/python -m bench.cpu.scoring [--workers 2] [--prompts 16] [--samples 16] [--scale 100]

Builds a synthetic BIRD-layout dataset whose databases are large enough that the chosen gold
queries take 10-100 ms, then scores the same groups (16 samples each, a realistic mix of
duplicates, equivalent rewrites, wrong answers and no-SQL) three ways:
  serial   every sample's SQL and its gold, one after another, in this process (the naive scorer)
  pool     the same queries, all submitted at once to SqlPool(workers)
  pool+    score_group: gold once per prompt (GoldCache), each distinct prediction once per group
Prints a Markdown table.
"""
from __future__ import annotations

import os
import sys

# Run as a script, sys.path[0] is bench/cpu/, where a sibling module could shadow the standard library
# (a queue.py would): replace it with the repo root before anything imports `queue`.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from policies.sql_reward import extract_sql  # noqa: E402
from tasks.bird import load_split  # noqa: E402
from tasks.sandbox import GoldCache, execute_readonly, score_group  # noqa: E402
from tasks.sql_pool import SqlPool  # noqa: E402
from tasks.synthetic import write_dataset  # noqa: E402


def completions_for(q, k: int) -> list[str]:
    """A group as a policy mid-training produces it: the right query a few times, equivalent
    rewrites, a couple of wrong queries, and some answers without SQL."""
    gold = q.sql
    rewrite = f"SELECT * FROM ({gold})"
    wrong = gold.replace("COUNT(*)", "COUNT(*) + 1") if "COUNT(*)" in gold else f"SELECT * FROM ({gold}) LIMIT 0"
    mix = [gold] * 6 + [rewrite] * 4 + [wrong] * 3 + [None] * 3
    return [f"<think>...</think>\n```sql\n{s}\n```" if s else "I am not sure." for s in (mix * 2)[:k]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--scale", type=int, default=100)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        bird = write_dataset(os.path.join(tmp, "bird"), num_databases=2, num_questions=160, scale=args.scale)
        heavy = []
        for q in load_split(bird, "train"):
            r = execute_readonly(q.db_path, q.sql, 30, 100_000)
            if r.status == "ok" and 0.010 <= r.seconds <= 0.100:
                heavy.append((q, r.seconds))
        heavy = heavy[: args.prompts]
        if len(heavy) < args.prompts:
            sys.exit(f"only {len(heavy)} gold queries in 10-100 ms at scale {args.scale}; raise --scale")
        gold_ms = statistics.median(s for _, s in heavy) * 1000
        groups = [(q, completions_for(q, args.samples)) for q, _ in heavy]
        n_samples = sum(len(t) for _, t in groups)

        # serial: the naive scorer, every sample runs its prediction and its gold
        jobs = []
        for q, texts in groups:
            for t in texts:
                sql = extract_sql(t)
                jobs.append((q.db_path, q.sql))
                if sql:
                    jobs.append((q.db_path, sql))
        start = time.perf_counter()
        for db, sql in jobs:
            execute_readonly(db, sql, 30, 100_000)
        serial_s = time.perf_counter() - start

        with SqlPool(workers=args.workers, timeout_s=30, max_rows=100_000) as pool:
            pool.run_many([(q.db_path, "SELECT 1") for q, _ in groups][: args.workers * 2])  # warm connections
            start = time.perf_counter()
            pool.run_many(jobs)
            pool_s = time.perf_counter() - start

            cache = GoldCache(4096)
            before = pool.queries

            async def score_all():
                return await asyncio.gather(*(score_group(pool, q.db_path, q.sql, texts, cache) for q, texts in groups))

            start = time.perf_counter()
            results = asyncio.run(score_all())
            dedup_s = time.perf_counter() - start
            dedup_queries = pool.queries - before
        assert all(not r.gold_failed for r in results)

    serial_rate, pool_rate, dedup_rate = n_samples / serial_s, n_samples / pool_s, n_samples / dedup_s
    print(f"{len(groups)} prompts x {args.samples} samples, scale {args.scale}, median gold query {gold_ms:.1f} ms, "
          f"workers={args.workers}\n")
    print("| mode | queries run | seconds | samples/s | vs serial |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| serial, in-process, no cache/dedup | {len(jobs)} | {serial_s:.2f} | {serial_rate:.1f} | 1.00x |")
    print(f"| SqlPool({args.workers}), no cache/dedup | {len(jobs)} | {pool_s:.2f} | {pool_rate:.1f} | "
          f"{pool_rate / serial_rate:.2f}x (target >= {0.8 * args.workers:.1f}x) |")
    print(f"| SqlPool({args.workers}) + gold cache + in-group dedup | {dedup_queries} | {dedup_s:.2f} | {dedup_rate:.1f} | "
          f"{dedup_rate / serial_rate:.2f}x |")
    print(f"\ngold executions: {cache.misses} for {len(groups)} prompts (once per prompt); "
          f"predicted queries run: {sum(r.executed for r in results)} for {n_samples} samples")


if __name__ == "__main__":
    main()
