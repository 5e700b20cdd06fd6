"""Read-only, time-, row- and memory-limited SQL execution, and the pool that runs it.

Invariants:
- A query can never change a database file: the connection is opened mode=ro, PRAGMA
  query_only is on, and an authorizer allows only reads (no ATTACH, writes, schema changes,
  PRAGMA, transactions or extension loading).
- A query never runs past its deadline: a progress handler interrupts it inside SQLite after
  `timeout_s`, and the pool kills (and replaces) a worker that has not answered `grace_s` later,
  even one stuck in C code. A query never spills temp files: temp storage is in memory and the
  SQLite heap, value sizes and the worker's address space are capped.
- One bad query never takes the pool down: a dead worker's job gets an error result and the
  worker is replaced; every other job keeps running.
- A query's deadline starts when a worker that is up takes it: jobs go only to workers that have said
  ready (one that does not within START_S is replaced), so an interpreter's start-up on a loaded host
  is queue wait, never a query's timeout.
- Runaway queries cannot starve the others while the pool may grow: with `max_workers` above
  `workers`, the pool starts a worker for each query no free worker can take, and one spare ahead
  whenever every worker is busy (up to `max_workers`), so a query arriving behind runaways starts at
  once; extra workers idle for `idle_s` are retired. At `max_workers` busy, a query waits at most one
  timeout plus the grace. Every result says how long it waited for a worker (`queue_wait_s`) apart
  from its execution (`seconds`).
- Results are lists of tuples of hashable values (int, float, str, bytes, None), so BIRD's
  set comparison works on them directly.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from queues.errors import one_line

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
_READY = "ready"  # a worker's first message: it is up and its limits are set
START_S = 60.0  # a worker that has not said ready by then is replaced


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
# Worker processes


def _worker_main(conn, memory_mb: int, temp_store_mb: int) -> None:
    """A pool worker: applies its own limits once, then answers jobs until its pipe closes."""
    import resource

    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:  # SQLite's own heap cap (temp b-trees, sorter, page cache): NOMEM instead of growth
        sqlite3.connect(":memory:").execute(f"PRAGMA hard_heap_limit = {temp_store_mb * 1024 * 1024}")
    except sqlite3.Error:
        pass
    connections: collections.OrderedDict[str, sqlite3.Connection] = collections.OrderedDict()
    try:
        conn.send(_READY)
    except OSError:
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        db_path, sql, timeout_s, max_rows = job
        try:
            db = connections.get(db_path)
            if db is None:  # a few connections kept open: BIRD groups hit the same database
                db = connections[db_path] = open_readonly(db_path, temp_store_mb)
                if len(connections) > 8:
                    connections.popitem(last=False)[1].close()
            connections.move_to_end(db_path)
            result = execute_readonly(db_path, sql, timeout_s, max_rows, temp_store_mb, conn=db)
        except MemoryError:
            result = ExecResult(ERROR, error="MemoryError: worker memory limit reached")
        except Exception as e:  # noqa: BLE001 - the worker must answer, whatever went wrong
            result = ExecResult(ERROR, error=one_line(e, 300))
        try:
            conn.send((result.status, result.rows, result.error, result.seconds, result.columns))
        except MemoryError:
            conn.send((ERROR, [], "MemoryError: result too large for the worker memory limit", result.seconds, []))


@dataclass
class _Job:
    db_path: str
    sql: str
    future: concurrent.futures.Future
    submitted: float = field(default_factory=time.monotonic)
    started: float = 0.0


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from tasks.sandbox import _worker_entry; "
    "_worker_entry(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))"
)


def _worker_entry(fd: int, memory_mb: int, temp_store_mb: int) -> None:
    _worker_main(multiprocessing.connection.Connection(fd), memory_mb, temp_store_mb)


class _Worker:
    """One worker process, started as a fresh interpreter (never a fork of a threaded parent,
    and never a re-import of the caller's __main__ as multiprocessing's spawn would do)."""

    def __init__(self, memory_mb: int, temp_store_mb: int, env_tmp: str):
        parent, child = socket.socketpair()
        # SQLITE_TMPDIR points SQLite (should anything still spill) at a directory the pool owns.
        env = dict(os.environ, SQLITE_TMPDIR=env_tmp, TMPDIR=env_tmp)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, _REPO_ROOT, str(child.fileno()), str(memory_mb), str(temp_store_mb)],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        child.close()
        self.conn = multiprocessing.connection.Connection(parent.detach())
        self.job: _Job | None = None
        self.deadline = 0.0
        self.idle_since = time.monotonic()
        self.ready = False  # until its first message: jobs go to ready workers only
        self.start_deadline = time.monotonic() + START_S

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        try:
            self.process.kill()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class SqlPool:
    """A pool of sandboxed SQLite worker processes with a wall-clock deadline per query.

    `submit` is thread-safe and returns a concurrent Future; `run` awaits one query,
    `run_many` runs a list of (db_path, sql) in parallel. One dispatcher thread owns the workers:
    it hands jobs to idle workers, collects answers, and kills a worker whose answer is more than
    `grace_s` past the query's timeout, answering its job "timeout" and starting a replacement.
    `max_workers` (default `workers`: a fixed pool) lets it grow while every worker is busy; extra
    workers idle for `idle_s` are retired, down to `workers`.
    """

    def __init__(self, workers: int = 8, timeout_s: float = 30.0, max_rows: int = 100_000,
                 memory_mb: int = 2048, temp_store_mb: int = 256, grace_s: float = 0.5,
                 max_workers: int | None = None, idle_s: float = 30.0):
        if workers < 1:
            raise ValueError(f"SqlPool workers must be >= 1, got {workers}")
        if max_workers is not None and max_workers < workers:
            raise ValueError(f"SqlPool max_workers must be >= workers ({workers}), got {max_workers}")
        self.timeout_s, self.max_rows, self.grace_s = timeout_s, max_rows, grace_s
        self.min_workers, self.max_workers, self.idle_s = workers, max_workers or workers, idle_s
        self.memory_mb, self.temp_store_mb = memory_mb, temp_store_mb
        self.tmp_dir = tempfile.mkdtemp(prefix="arl-sqlpool-")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._workers = [self._spawn() for _ in range(workers)]
        self._closed = False
        self.replaced = 0  # workers killed or dead and replaced
        self.queries = 0  # queries answered
        self.grown = 0  # extra workers started beyond `workers` (retired ones included)
        self.peak_workers = workers
        self.queue_wait_s = 0.0  # summed over answered queries
        self.killed_pids: list[int] = []
        self._thread = threading.Thread(target=self._dispatch, name="sqlpool-dispatch", daemon=True)
        self._thread.start()

    def _spawn(self) -> _Worker:
        return _Worker(self.memory_mb, self.temp_store_mb, self.tmp_dir)

    # -- public API ---------------------------------------------------------------------------

    def submit(self, db_path: str, sql: str) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("SqlPool is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(_Job(db_path, sql, fut))
        self._wake_w.send(b"x")
        return fut

    async def run(self, db_path: str, sql: str) -> ExecResult:
        return await asyncio.wrap_future(self.submit(db_path, sql))

    def run_many(self, jobs: list[tuple[str, str]]) -> list[ExecResult]:
        futures = [self.submit(db, sql) for db, sql in jobs]
        return [f.result() for f in futures]

    def wait_ready(self, timeout_s: float = START_S) -> bool:
        """Waits (bounded) until every worker has started; True when they all have."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in list(self._workers)):
            if time.monotonic() > deadline or self._closed:
                return False
            time.sleep(0.02)
        return True

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    @property
    def workers(self) -> int:
        return len(self._workers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)
        for w in self._workers:
            w.kill()
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- dispatcher thread --------------------------------------------------------------------

    def _dispatch(self) -> None:
        pending: collections.deque[_Job] = collections.deque()
        stopping = False
        while True:
            while True:  # drain new jobs
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                else:
                    pending.append(job)
            if stopping:
                for job in pending:
                    job.future.set_result(ExecResult(ERROR, error="SqlPool closed"))
                for w in self._workers:
                    if w.job is not None:
                        w.job.future.set_result(ExecResult(ERROR, error="SqlPool closed"))
                        w.job = None
                return
            for i, w in enumerate(self._workers):
                if w.ready and w.job is None and pending and w.process.poll() is not None:
                    self._replace(i)  # died while idle: never hand it a job
                    w = self._workers[i]
                if w.ready and w.job is None and pending:
                    self._assign(w, pending)
            free = sum(w.job is None for w in self._workers)  # idle or still starting
            while len(pending) > free and len(self._workers) < self.max_workers:  # every worker busy: grow
                self._grow()
                free += 1
            if free == 0 and len(self._workers) < self.max_workers:
                self._grow()  # one spare started ahead: the next query need not wait for an interpreter
            busy = [w for w in self._workers if w.job is not None]
            starting = [w for w in self._workers if not w.ready]
            now = time.monotonic()
            wait_s = max(0.0, min([w.deadline for w in busy] + [w.start_deadline for w in starting], default=now + 1.0) - now)
            if len(self._workers) > self.min_workers:  # wake to retire an extra idle worker
                wait_s = min(wait_s, self.idle_s)
            ready = multiprocessing.connection.wait([self._wake_r] + [w.conn for w in busy + starting], timeout=wait_s)
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            for i, w in enumerate(self._workers):
                if not w.ready:
                    self._check_started(i, w, w.conn in ready)
                elif w.job is None:
                    continue
                elif w.conn in ready:
                    try:
                        status, rows, error, seconds, columns = w.conn.recv()
                        self._finish(w, ExecResult(status, rows, error, seconds, columns))
                    except (EOFError, OSError):  # died mid-query (e.g. killed by the kernel)
                        self._replace(i)  # replaced before answering: callers never see a dead worker
                        self._finish(w, ExecResult(ERROR, error="worker process died while running the query"))
                elif time.monotonic() > w.deadline:
                    self._replace(i)
                    self._finish(w, ExecResult(TIMEOUT, error=f"exceeded {self.timeout_s:g} s (worker killed)",
                                               seconds=self.timeout_s + self.grace_s))
            self._retire_idle()

    def _check_started(self, i: int, w: _Worker, readable: bool) -> None:
        """A starting worker becomes ready on its first message; one that died or did not start within
        START_S is replaced. Its start-up never counts against a query's deadline."""
        if readable:
            try:
                if w.conn.recv() == _READY:
                    w.ready, w.idle_since = True, time.monotonic()
                    return
            except (EOFError, OSError):
                pass
            self._replace(i)
        elif time.monotonic() > w.start_deadline:
            self._replace(i)

    def _assign(self, w: _Worker, pending: collections.deque) -> None:
        job = pending.popleft()
        if not job.future.set_running_or_notify_cancel():
            return
        job.started = time.monotonic()
        w.job, w.deadline = job, job.started + self.timeout_s + self.grace_s
        try:
            w.conn.send((job.db_path, job.sql, self.timeout_s, self.max_rows))
        except OSError:
            w.deadline = 0.0  # a dead worker: the deadline sweep replaces it

    def _grow(self) -> None:
        self._workers.append(self._spawn())
        self.grown += 1
        self.peak_workers = max(self.peak_workers, len(self._workers))

    def _retire_idle(self) -> None:
        """Extra workers (beyond `workers`) idle for `idle_s` are stopped, one idle worker kept while
        all the others are busy."""
        now = time.monotonic()
        for w in list(self._workers):
            if len(self._workers) <= self.min_workers:
                return
            idle = sum(x.ready and x.job is None for x in self._workers)
            if w.ready and w.job is None and now - w.idle_since > self.idle_s and idle > 1:
                self._workers.remove(w)
                w.kill()

    def _finish(self, w: _Worker, result: ExecResult) -> None:
        job, w.job = w.job, None
        w.idle_since = time.monotonic()
        self.queries += 1
        wait = max(0.0, job.started - job.submitted)
        self.queue_wait_s += wait
        if not job.future.done():
            job.future.set_result(dataclasses.replace(result, queue_wait_s=round(wait, 4)))

    def _replace(self, i: int) -> None:
        old = self._workers[i]
        self.killed_pids.append(old.pid)
        old.kill()
        self._workers[i] = self._spawn()
        self.replaced += 1


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
