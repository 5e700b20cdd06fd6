"""The pool of sandboxed SQLite worker processes that runs tasks/sql_exec.py's execution with a
wall-clock deadline per query (the scorer, the generator's tools, launch.eval and launch.serve use it;
tasks/sandbox.py re-exports it).

Invariants:
- A query never runs past its deadline: SQLite interrupts it after `timeout_s` (tasks/sql_exec.py),
  and the pool kills (and replaces) a worker that has not answered `grace_s` later, even one stuck in
  C code. Each worker caps its own address space and SQLite's heap once, at start.
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
- Workers are fresh interpreters (never a fork of a threaded parent) that import only this module,
  tasks/sql_exec.py and queues.errors (stdlib only).
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
from dataclasses import dataclass, field

from queues.errors import one_line
from tasks.sql_exec import ERROR, TIMEOUT, ExecResult, execute_readonly, open_readonly

_READY = "ready"  # a worker's first message: it is up and its limits are set
START_S = 60.0  # a worker that has not said ready by then is replaced


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
    "import sys; sys.path.insert(0, sys.argv[1]); from tasks.sql_pool import _worker_entry; "
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
    def alive(self) -> bool:
        """Open and its dispatcher thread running (what a health check asks)."""
        return not self._closed and self._thread.is_alive()

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
