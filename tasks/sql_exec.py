"""Read-only, time-, row- and memory-limited SQL execution in this process: one query, one result.
tasks/sql_pool.py runs it in worker processes; tasks/sandbox.py is the import point of both.

Invariants:
- A query can never change a database file: the connection is opened mode=ro, PRAGMA
  query_only is on, and an authorizer allows only reads (no ATTACH, writes, schema changes,
  PRAGMA, transactions or extension loading).
- A query never runs past its deadline inside SQLite: a progress handler interrupts it after
  `timeout_s` (the pool also kills a worker stuck in C code). A query never spills temp files: temp
  storage is in memory and value sizes are capped (the pool caps each worker's SQLite heap and
  address space).
- Results are lists of tuples of hashable values (int, float, str, bytes, None), so BIRD's
  set comparison works on them directly.
- Stdlib only (and queues.errors): the pool's worker processes import it.
"""
from __future__ import annotations

import os
import sqlite3
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
