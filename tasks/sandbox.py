"""The SQL sandbox's one import point, and scoring a group of completions through it.

Two concerns live beside it: tasks/sql_exec.py executes one query read-only under time, row and
memory limits (ExecResult, execute_readonly, open_readonly, the statuses), tasks/sql_pool.py runs
that in a pool of worker processes with a wall-clock deadline per query (SqlPool). Both are imported
here, so `from tasks.sandbox import SqlPool, execute_readonly, ...` works for every caller (bench/peers'
TRL process included); each module's invariants are in its own docstring.

Invariants:
- Scoring runs the gold query once per (database, gold SQL) however many groups race for it
  (GoldCache) and each distinct predicted query of a group once; a failed gold query makes the group
  gold_failed, never an exception.
- Stdlib only (and queues.errors, policies.sql_reward at call time): bench/peers' TRL process imports it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from dataclasses import dataclass

from tasks.sql_exec import ERROR, OK, TIMEOUT, TOO_MANY_ROWS, ExecResult, execute_readonly, open_readonly
from tasks.sql_pool import SqlPool

__all__ = ["ERROR", "OK", "TIMEOUT", "TOO_MANY_ROWS", "ExecResult", "execute_readonly", "open_readonly", "SqlPool",
           "GoldCache", "GroupScore", "score_group"]


class GoldCache:
    """LRU of gold results keyed by (database path, gold SQL); thread- and task-safe.

    Concurrent requests for the same key share one execution (the first caller runs it, the
    others await its future), so a gold query runs once per prompt however many groups race.
    """

    def __init__(self, size: int = 4096):
        self.size = size
        self._items: collections.OrderedDict[tuple[str, str], ExecResult] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_future(self, pool: SqlPool, db_path: str, sql: str) -> concurrent.futures.Future:
        key = (db_path, sql)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_result(self._items[key])
                return fut
            if key in self._inflight:
                self.hits += 1
                return self._inflight[key]
            self.misses += 1
            fut = pool.submit(db_path, sql)
            self._inflight[key] = fut
        fut.add_done_callback(lambda f, key=key: self._store(key, f))
        return fut

    def _store(self, key, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if fut.cancelled() or fut.exception() is not None or self.size <= 0:
                return
            self._items[key] = fut.result()
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class GroupScore:
    rewards: list[float]
    verdicts: list[str]
    gold_failed: bool
    executed: int  # distinct predicted queries actually run (after in-group dedup)
    gold_error: str = ""

    def __iter__(self):  # rewards, verdicts, gold_failed = score_group(...)
        return iter((self.rewards, self.verdicts, self.gold_failed))


async def score_group(pool: SqlPool, db_path: str, gold_sql: str, completion_texts: list[str],
                      gold_cache: GoldCache | None = None, answers: list[str | None] | None = None) -> GroupScore:
    """Scores one prompt's completions: gold once (cached), each distinct predicted SQL once.
    `answers[i]`, where given and not None, is completion i's SQL as is (a multi-turn episode's
    final answer); otherwise it is extracted from the text."""
    from policies.sql_reward import extract_sql, reward_for, verdict_for

    gold_fut = (gold_cache.get_future(pool, db_path, gold_sql) if gold_cache is not None
                else pool.submit(db_path, gold_sql))
    preds = [((answers[i] or None) if answers is not None and answers[i] is not None else extract_sql(t))
             for i, t in enumerate(completion_texts)]  # an empty given answer is "no_sql"
    distinct = sorted({p for p in preds if p is not None})
    pred_futs = {sql: pool.submit(db_path, sql) for sql in distinct}
    gold = await asyncio.wrap_future(gold_fut)
    results = {sql: await asyncio.wrap_future(f) for sql, f in pred_futs.items()}
    verdicts = []
    for p in preds:
        if p is None:
            verdicts.append(verdict_for("no_sql", [], gold.status, gold.rows))
        else:
            r = results[p]
            verdicts.append(verdict_for(r.status, r.rows, gold.status, gold.rows))
    gold_failed = gold.status != OK
    rewards = [reward_for(v) for v in verdicts]
    return GroupScore(rewards, verdicts, gold_failed, len(distinct), gold.error if gold_failed else "")
