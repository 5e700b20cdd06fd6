"""The SQL sandbox: read-only, deadline, row, memory and temp-file limits; pool survival."""
import hashlib
import os
import signal
import sqlite3
import time

import pytest

from tasks.sandbox import ERROR, OK, TIMEOUT, TOO_MANY_ROWS, GoldCache, execute_readonly, score_group
from tasks.sql_pool import SqlPool

TIMEOUT_S = 1.0
# How long a test waits for a result before it fails instead of hanging. A query that ignored its 1 s
# deadline would never answer; 60 s leaves room for workers starved of CPU at load 30+ on 2 cores (the
# deadline itself is shown by the result's status, a worker's kill by pool.killed_pids, never by a clock).
GUARD_S = 60.0


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = tmp_path_factory.mktemp("sandbox_db")
    path = d / "shop.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, score REAL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), qty INTEGER);
    """)
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)",
                     [(i, f"name{i}", ["Oslo", "Lima", None][i % 3], i / 7) for i in range(1, 2001)])
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?)", [(i, 1 + i % 2000, i % 9) for i in range(1, 5001)])
    conn.commit()
    conn.close()
    os.chmod(path, 0o644)
    return path


@pytest.fixture(scope="module")
def pool():
    p = SqlPool(workers=2, timeout_s=TIMEOUT_S, max_rows=1000, memory_mb=1024, temp_store_mb=64, grace_s=0.3)
    assert p.wait_ready(60)  # the timings below are the queries', not the interpreters' start-up
    yield p
    pids = p.worker_pids() + p.killed_pids
    p.close()
    for pid in pids:  # no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


HOSTILE = {
    "endless_recursive_cte": ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r", TIMEOUT),
    "endless_cte_rows": ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT x FROM r", TOO_MANY_ROWS),
    "cartesian_3way": ("SELECT count(*) FROM customers a, customers b, customers c", TIMEOUT),
    "cartesian_5way_sorted": ("SELECT a.name FROM customers a, customers b, orders c, orders d, orders e ORDER BY random() LIMIT 1", TIMEOUT),
    "sort_spill": ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r LIMIT 50000000) "
                   "SELECT x, randomblob(200) FROM r ORDER BY 2 LIMIT 1", (TIMEOUT, ERROR)),
    "distinct_spill": ("SELECT count(DISTINCT a.id * 100000000 + b.id * 10000 + c.id) FROM customers a, customers b, orders c", (TIMEOUT, ERROR)),
    "group_concat_huge": ("SELECT group_concat(a.name || b.name) FROM customers a, customers b", (TIMEOUT, ERROR)),
    "huge_result": ("SELECT * FROM customers a, orders b", TOO_MANY_ROWS),
    "attach_file": ("ATTACH DATABASE '/tmp/arl_evil.sqlite' AS evil", ERROR),
    "attach_memory": ("ATTACH ':memory:' AS m", ERROR),
    "detach_main": ("DETACH main", ERROR),
    "pragma_query_only_off": ("PRAGMA query_only = 0", ERROR),
    "pragma_journal_wal": ("PRAGMA journal_mode = WAL", ERROR),
    "pragma_writable_schema": ("PRAGMA writable_schema = 1", ERROR),
    "pragma_temp_dir": ("PRAGMA temp_store_directory = '/tmp'", ERROR),
    "drop_table": ("DROP TABLE customers", ERROR),
    "insert": ("INSERT INTO customers VALUES (9999, 'x', 'y', 0)", ERROR),
    "update": ("UPDATE customers SET name = 'pwned'", ERROR),
    "delete": ("DELETE FROM orders", ERROR),
    "replace_into": ("REPLACE INTO customers VALUES (1, 'x', 'y', 0)", ERROR),
    "create_table": ("CREATE TABLE t (x)", ERROR),
    "create_temp_table": ("CREATE TEMP TABLE t AS SELECT * FROM customers", ERROR),
    "create_index": ("CREATE INDEX i ON customers(name)", ERROR),
    "create_view": ("CREATE VIEW v AS SELECT 1", ERROR),
    "create_trigger": ("CREATE TRIGGER tr AFTER INSERT ON customers BEGIN SELECT 1; END", ERROR),
    "alter_table": ("ALTER TABLE customers ADD COLUMN z", ERROR),
    "virtual_table": ("CREATE VIRTUAL TABLE f USING fts5(x)", ERROR),
    "vacuum_into": ("VACUUM INTO '/tmp/arl_evil_copy.sqlite'", ERROR),
    "vacuum": ("VACUUM", ERROR),
    "reindex": ("REINDEX", ERROR),
    "analyze": ("ANALYZE", ERROR),
    "begin_transaction": ("BEGIN IMMEDIATE", ERROR),
    "savepoint": ("SAVEPOINT s", ERROR),
    "stacked_statements": ("SELECT 1; DROP TABLE customers", ERROR),
    "load_extension": ("SELECT load_extension('/usr/lib/x86_64-linux-gnu/libm.so.6')", ERROR),
    "readfile": ("SELECT readfile('/etc/passwd')", ERROR),
    "randomblob_huge": ("SELECT randomblob(2000000000)", ERROR),
    "zeroblob_huge_length": ("SELECT length(zeroblob(1500000000))", ERROR),
    "printf_huge": ("SELECT printf('%.*c', 2000000000, 'x')", (ERROR, TIMEOUT)),  # loops in C: the pool kills it
    "replace_growth": ("SELECT length(replace(hex(zeroblob(4000000)), '0', hex(zeroblob(64))))", ERROR),
    "deep_nesting": ("SELECT " + "(" * 5000 + "1" + ")" * 5000, ERROR),
    "pragma_function_write": ("SELECT * FROM pragma_journal_mode('wal')", ERROR),
    "comment_only": ("-- nothing here", ERROR),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_query_is_contained(name, pool, db):
    sql, expected = HOSTILE[name]
    expected = expected if isinstance(expected, tuple) else (expected,)
    before_hash, before_files = _sha(db), sorted(os.listdir(db.parent))
    result = pool.submit(str(db), sql).result(timeout=GUARD_S)
    assert result.status in expected, (result.status, result.error)
    assert _sha(db) == before_hash
    assert sorted(os.listdir(db.parent)) == before_files  # no journal, WAL or copy next to it
    assert os.listdir(pool.tmp_dir) == []  # nothing spilled to temp files
    assert not os.path.exists("/tmp/arl_evil.sqlite") and not os.path.exists("/tmp/arl_evil_copy.sqlite")
    assert pool.workers == 2
    for pid in pool.killed_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The pool still answers ordinary queries after each hostile one.
    assert pool.run_many([(str(db), "SELECT count(*) FROM orders")])[0].rows == [(5000,)]


def test_reads_return_hashable_rows_with_nulls(pool, db):
    r = pool.run_many([(str(db), "SELECT city, count(*) FROM customers GROUP BY city ORDER BY city")])[0]
    assert r.status == OK
    assert r.rows == [(None, 667), ("Lima", 667), ("Oslo", 666)]
    assert len(set(r.rows)) == 3


def test_hung_worker_is_killed_and_replaced(pool, db):
    """A worker that stops answering (as if stuck in C code) is killed at the wall-clock deadline."""
    assert pool.wait_ready(60)  # hung while up (a worker stopped before it is up never gets a query)
    victims = pool.worker_pids()
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    results = [f.result(timeout=GUARD_S) for f in [pool.submit(str(db), "SELECT 1"), pool.submit(str(db), "SELECT 2")]]
    assert [(r.status, r.error) for r in results] == [(TIMEOUT, f"exceeded {TIMEOUT_S:g} s (worker killed)")] * 2
    assert set(victims) <= set(pool.killed_pids)
    assert not set(victims) & set(pool.worker_pids())
    assert pool.run_many([(str(db), "SELECT 3")])[0].rows == [(3,)]


def test_dead_idle_worker_is_replaced_before_it_gets_a_job(pool, db):
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    _wait_dead(victim)  # dead before the jobs arrive (a worker dying mid-job is another test's case)
    results = pool.run_many([(str(db), f"SELECT {i}") for i in range(6)])
    assert [r.rows for r in results] == [[(i,)] for i in range(6)]
    assert victim not in pool.worker_pids()


ENDLESS = HOSTILE["endless_recursive_cte"][0]


def _wait_dead(pid: int) -> None:
    """Until `pid` has exited (a zombie waiting for the pool to reap it, or gone), at most GUARD_S."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {pid} still alive {GUARD_S:g} s after SIGKILL")


def _gone(pids) -> bool:
    out = True
    for pid in pids:
        try:
            os.kill(pid, 0)
            out = False
        except ProcessLookupError:
            pass
    return out


def test_runaway_queries_do_not_starve_a_trivial_one_when_the_pool_may_grow(db):
    """Three endless queries on a pool of 2 that may grow to 5: a trivial SELECT sent behind them is
    answered while all three still run, on a worker the pool started ahead; its queue wait is reported
    apart from its execution. Extra workers retire when idle, every one is gone after close."""
    # timeout_s=600: the runaways outlive the trivial query however slowly a spare interpreter starts.
    with SqlPool(workers=2, max_workers=5, timeout_s=600, grace_s=1, max_rows=1000, memory_mb=512,
                 temp_store_mb=32, idle_s=600) as p:
        runaway = [p.submit(str(db), ENDLESS) for _ in range(3)]
        trivial = p.submit(str(db), "SELECT count(*) FROM customers").result(timeout=GUARD_S)
        assert trivial.status == OK and trivial.rows == [(2000,)]
        assert not any(f.done() for f in runaway)  # answered while the three still run
        assert p.workers == 5 and p.grown == 3  # one for the third runaway, one spare, one spare again
        assert trivial.queue_wait_s >= 0 and trivial.seconds >= 0
        pids = p.worker_pids()
    assert [f.result(timeout=10).error for f in runaway] == ["SqlPool closed"] * 3
    assert _gone(pids)
    with SqlPool(workers=1, max_workers=3, timeout_s=TIMEOUT_S, grace_s=0.3, max_rows=1000, memory_mb=512,
                 temp_store_mb=32, idle_s=0.2) as p:
        assert [r.status for r in p.run_many([(str(db), ENDLESS)] * 3)] == [TIMEOUT] * 3
        assert p.peak_workers == 3
        deadline = time.monotonic() + 30
        while p.workers > 1 and time.monotonic() < deadline:  # idle extras retire, down to `workers`
            time.sleep(0.1)
        assert p.workers == 1
        assert p.run_many([(str(db), "SELECT 7")])[0].rows == [(7,)]  # (and a spare starts again beside it)


def test_a_fixed_pool_reports_the_wait_behind_runaways_as_queue_wait(db):
    """The same three runaways on a fixed pool of 2 (the default, max_workers == workers): the trivial
    SELECT starts only when one of them has been interrupted at its deadline, and that wait is its
    queue_wait_s, not its execution."""
    with SqlPool(workers=2, timeout_s=TIMEOUT_S, grace_s=0.3, max_rows=1000, memory_mb=512, temp_store_mb=32) as p:
        first_submitted = time.monotonic()
        runaway = [p.submit(str(db), ENDLESS) for _ in range(3)]
        trivial_future = p.submit(str(db), "SELECT count(*) FROM customers")
        gap = time.monotonic() - first_submitted  # the trivial query was submitted at most this after a runaway
        trivial = trivial_future.result(timeout=GUARD_S)
        assert trivial.status == OK and p.workers == 2 and p.grown == 0
        assert any(f.done() for f in runaway)  # it started only once a runaway had ended
        # Queued behind a runaway until that one's deadline: a runaway's deadline starts when a worker
        # takes it (>= its submission), so the trivial query waited at least TIMEOUT_S less the gap.
        assert trivial.queue_wait_s >= TIMEOUT_S - gap, (trivial.queue_wait_s, gap)
        assert [f.result(timeout=30).status for f in runaway] == [TIMEOUT] * 3


def test_memory_limit_stops_a_memory_hungry_query(tmp_path, db):
    with SqlPool(workers=1, timeout_s=5, max_rows=10_000_000, memory_mb=300, temp_store_mb=32) as small:
        r = small.run_many([(str(db), "SELECT a.name, b.name, c.qty FROM customers a, customers b, orders c LIMIT 3000000")])[0]
        assert r.status in (ERROR, TIMEOUT, TOO_MANY_ROWS)
        assert small.run_many([(str(db), "SELECT 7")])[0].rows == [(7,)]


def test_execute_readonly_in_process_and_missing_file(db, tmp_path):
    assert execute_readonly(str(db), "SELECT count(*) FROM customers", 2, 10).rows == [(2000,)]
    r = execute_readonly(str(tmp_path / "nope.sqlite"), "SELECT 1", 2, 10)
    assert r.status == ERROR and "nope.sqlite" in r.error


async def test_score_group_dedups_and_caches_gold(pool, db):
    cache = GoldCache(16)
    gold = "SELECT city, count(*) FROM customers GROUP BY city"
    texts = ["```sql\nSELECT city, count(*) FROM customers GROUP BY city ORDER BY 2\n```"] * 6 + \
            ["```sql\nSELECT count(*), city FROM customers GROUP BY city\n```"] * 5 + \
            ["no idea"] * 3 + ["```sql\nSELECT nope FROM customers\n```"] * 2
    before = pool.queries
    res = await score_group(pool, str(db), gold, texts, cache)
    assert res.verdicts == ["match"] * 6 + ["wrong_result"] * 5 + ["no_sql"] * 3 + ["sql_error"] * 2
    assert res.rewards == [1.0] * 6 + [0.1] * 5 + [0.0] * 5
    assert not res.gold_failed and res.executed == 3
    assert pool.queries - before == 4  # gold + 3 distinct predictions for 16 samples
    again = await score_group(pool, str(db), gold, texts[:1], cache)
    assert again.verdicts == ["match"] and (cache.hits, cache.misses) == (1, 1)


async def test_failing_gold_marks_the_group(pool, db):
    res = await score_group(pool, str(db), "SELECT missing_col FROM customers", ["SELECT 1"] * 3, GoldCache(4))
    assert res.gold_failed and res.verdicts == ["gold_failed"] * 3 and res.rewards == [0.0] * 3
    slow = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"
    res = await score_group(pool, str(db), slow, ["SELECT 1"], GoldCache(4))
    assert res.gold_failed and "exceeded" in res.gold_error


def test_gold_cache_is_lru():
    import concurrent.futures

    class OnePool:
        calls = 0

        def submit(self, db_path, sql):
            OnePool.calls += 1
            f = concurrent.futures.Future()
            f.set_result(sql)
            return f

    cache, p = GoldCache(2), OnePool()
    for key in ("a", "b", "a", "c", "a", "b"):
        cache.get_future(p, "db", key).result()
    assert OnePool.calls == 4 and len(cache) == 2  # b was evicted by c, then recomputed
