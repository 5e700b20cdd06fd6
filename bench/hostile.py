"""Hostile SQL and hostile inputs shared by the load and fault benches (bench/faults/soak.py's burst in the
rollouts stream, bench/serve/load.py's hostile clients).

Invariants: every entry is something a model or a user could send; none needs more than the sandbox's
own limits to be contained (its per-query deadline, row cap, memory cap, read-only connection). The
kinds are fixed names so reports can count them.
"""
from __future__ import annotations

ENDLESS_CTE = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
# kind -> SQL; "huge" is a query of ~100 kB whose text the parser must read (an over-long answer).
HOSTILE_SQL: dict[str, str] = {
    "endless_cte": ENDLESS_CTE,
    "write": "DROP TABLE IF EXISTS sqlite_master",
    "insert": "INSERT INTO sqlite_master VALUES ('table', 'x', 'x', 0, 'x')",
    "stacked": "SELECT 1; DELETE FROM sqlite_master",
    "attach": "ATTACH '/tmp/arl_hostile.sqlite' AS evil",
    "huge": "SELECT " + " + ".join(["1"] * 25_000),
    "cross_join_rows": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 5000000) SELECT x FROM c",
}


def huge_text(n_bytes: int) -> str:
    """A completion (or question) of about n_bytes that holds no SQL: garbage a model might emit."""
    unit = "lorem ipsum ``` <think> ; -- \x00 "
    return (unit * (n_bytes // len(unit) + 1))[:n_bytes]
