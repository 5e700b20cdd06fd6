"""Read-only, time-, row- and memory-limited SQL execution in this process, and scoring a group of
completions from its results. The pool of worker processes that runs it for the scorer, the generator's
tools, eval and serve is tasks/sql_pool.py (`SqlPool`, also importable from here).

Invariants:
- A query can never change a database file: the connection is opened mode=ro, PRAGMA
  query_only is on, and an authorizer allows only reads (no ATTACH, writes, schema changes,
  PRAGMA, transactions or extension loading).
- A query never runs past its deadline inside SQLite: a progress handler interrupts it after
  `timeout_s` (the pool also kills a worker stuck in C code: tasks/sql_pool.py). A query never spills
  temp files: temp storage is in memory and value sizes are capped (the SQLite heap and the address
  space are capped per worker process by the pool).
- Results are lists of tuples of hashable values (int, float, str, bytes, None), so BIRD's
  set comparison works on them directly.
- Scoring runs the gold query once per (database, gold SQL) however many groups race for it
  (GoldCache) and each distinct predicted query of a group once.
- Stdlib only (and queues.errors): the pool's worker processes and bench/peers' TRL process import it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import sqlite3
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from queues.errors import one_line

if TYPE_CHECKING:
    from tasks.sql_pool import SqlPool

OK = "ok"
ERROR = "error"
TIMEOUT = "timeout"
TOO_MANY_ROWS = "too_many_rows"


@dataclass(frozen=True)
class ExecResult:
    status: str  # ok | error | timeout | too_many_rows
    rows: list = field(default_factory=list)  # list of tuples (empty unless status == ok)
    error: str = ""
    seconds: float = 0.0
    columns: list = field(default_factory=list)  # the result's column names (status == ok)
    queue_wait_s: float = 0.0  # from submit to a worker taking it (SqlPool), apart from `seconds`


# Authorizer action codes a read-only SELECT needs; everything else is refused.
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_REFUSED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
_MAX_VALUE_BYTES = 10_000_000  # one string/blob; BIRD values are far smaller
_PROGRESS_OPS = 2_000  # VM instructions between deadline checks (~tens of microseconds)


def _authorizer(action, arg1, arg2, dbname, source):
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _REFUSED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def open_readonly(db_path: str, temp_store_mb: int = 256) -> sqlite3.Connection:
    """A connection that cannot write the file, attach others or load extensions."""
    if not os.path.isfile(db_path):
        raise FileNotFoundError(f"database file not found: {db_path}")
    uri = "file:" + urllib.parse.quote(os.path.abspath(db_path)) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    conn.execute("PRAGMA query_only = ON")
    conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temp b-trees never touch the disk
    conn.execute(f"PRAGMA cache_size = -{max(1024, temp_store_mb * 256)}")  # KiB; a quarter of the cap
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 1_000_000)
    conn.set_authorizer(_authorizer)
    conn.text_factory = lambda b: b.decode("utf-8", "replace")  # BIRD has a few non-UTF-8 cells
    return conn


def execute_readonly(db_path: str, sql: str, timeout_s: float = 30.0, max_rows: int = 100_000,
                     temp_store_mb: int = 256, conn: sqlite3.Connection | None = None) -> ExecResult:
    """Runs one query in this process under the sandbox's limits (see the module invariants)."""
    start = time.monotonic()
    deadline = start + timeout_s
    own = conn is None
    try:
        if own:
            conn = open_readonly(db_path, temp_store_mb)
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, _PROGRESS_OPS)
        cur = conn.execute(sql)
        if cur.description is None:
            return ExecResult(ERROR, error="not a query: the statement returns no columns", seconds=time.monotonic() - start)
        rows: list = []
        chunk = min(max_rows + 1, 1000)
        while True:
            batch = cur.fetchmany(chunk)
            if not batch:
                break
            rows.extend(batch)
            if len(rows) > max_rows:
                return ExecResult(TOO_MANY_ROWS, error=f"more than {max_rows} rows", seconds=time.monotonic() - start)
        return ExecResult(OK, rows=[tuple(r) for r in rows], seconds=time.monotonic() - start,
                          columns=[d[0] for d in cur.description])
    except sqlite3.OperationalError as e:
        if time.monotonic() > deadline or "interrupted" in str(e):
            return ExecResult(TIMEOUT, error=f"exceeded {timeout_s:g} s", seconds=time.monotonic() - start)
        return ExecResult(ERROR, error=one_line(e, 300), seconds=time.monotonic() - start)
    except (sqlite3.Error, MemoryError, OverflowError, ValueError, FileNotFoundError) as e:
        return ExecResult(ERROR, error=one_line(e, 300), seconds=time.monotonic() - start)
    finally:
        if conn is not None:
            conn.set_progress_handler(None, 0)
            if own:
                conn.close()


# ---------------------------------------------------------------------------------------------
# Gold cache and group scoring


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


def __getattr__(name: str):
    """`from tasks.sandbox import SqlPool` keeps working (bench/peers, older callers); imported on first
    use, since tasks/sql_pool.py imports this module."""
    if name == "SqlPool":
        from tasks.sql_pool import SqlPool

        return SqlPool
    raise AttributeError(f"module 'tasks.sandbox' has no attribute {name!r}")
