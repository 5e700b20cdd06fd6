"""The generator's tool executor: an episode's queries run read-only, bounded, off the event loop.

Invariants:
- Queries run in the scorer's sandbox (tasks/sql_pool.py SqlPool over tasks/sandbox.py: read-only
  connection, authorizer, per-query timeout enforced inside SQLite, row cap, memory limit) in the executor's OWN worker
  processes (`workers`), so a runaway query never blocks the generator's event loop, other episodes
  or the scorer.
- Every wait is bounded: a query answers within its timeout plus the pool's grace (a worker past it
  is killed and replaced); `run` additionally gives up after `timeout_s + GRACE_S` and answers
  "timeout" itself. Waits are counted (`wait_s`, `queries`, `errors`).
- A query's outcome is data, never an exception: (status, columns, rows, error).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from tasks.sandbox import ExecResult
from tasks.sql_pool import SqlPool

GRACE_S = 5.0


class ToolExecutor:
    def __init__(self, workers: int = 2, timeout_s: float = 30.0, max_rows: int = 100_000, memory_mb: int = 2048):
        if workers < 1:
            raise ValueError(f"generator.tool_workers must be >= 1, got {workers}")
        self.timeout_s = float(timeout_s)
        self.pool = SqlPool(workers=workers, timeout_s=timeout_s, max_rows=max_rows, memory_mb=memory_mb)
        self.queries = 0
        self.errors = 0
        self.wait_s = 0.0

    async def run(self, db_path: str, sql: str) -> ExecResult:
        """Runs one query; the result's `seconds` is the whole wait (queue + execution)."""
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(self.pool.run(db_path, sql), self.timeout_s + GRACE_S)
        except asyncio.TimeoutError:
            result = ExecResult("timeout", error=f"exceeded {self.timeout_s:g} s")
        except RuntimeError as e:  # the pool was closed under us
            result = ExecResult("error", error=str(e).splitlines()[0])
        waited = time.monotonic() - t0
        self.queries += 1
        self.errors += int(result.status != "ok")
        self.wait_s += waited
        return dataclasses.replace(result, seconds=waited)

    def stats(self) -> dict[str, float]:
        return {"tool_queries": float(self.queries), "tool_errors": float(self.errors),
                "executor_wait_s": self.wait_s, "tool_workers_replaced": float(self.pool.replaced)}

    def close(self) -> None:
        self.pool.close()
