"""launch.eval's default rule against BIRD's evaluation.py reimplemented from its definition, on a hand-made SQLite
database whose fixtures include empty golds, duplicates, row order, errors and timeouts (the queries run in the
SQL sandbox's worker processes; its bound 10 s: loose enough for a loaded machine)."""
import sqlite3
import time

import pytest

from launch.eval import evaluate, summary_table
from tasks.bird import Question
from tasks.sql_pool import SqlPool

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"


def official_ex(db_path: str, pred: str, gold: str, timeout_s: float) -> int:
    """BIRD evaluation.py's execute_model: run the prediction then the gold with plain sqlite3 under a
    timeout; any exception or timeout is 0, else set(pred) == set(gold)."""
    conn = sqlite3.connect(db_path)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        cur = conn.cursor()
        cur.execute(pred)
        p = cur.fetchall()
        cur.execute(gold)
        g = cur.fetchall()
        return int(set(p) == set(g))
    except Exception:
        return 0
    finally:
        conn.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("birdeval") / "shop.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE item(id INTEGER PRIMARY KEY, name TEXT, price REAL, kind TEXT);
        INSERT INTO item VALUES (1, 'pen', 1.5, 'office'), (2, 'ink', 3.0, 'office'), (3, 'cup', 3.0, 'kitchen'),
                                (4, 'pan', 20.0, 'kitchen');
    """)
    conn.commit()
    conn.close()
    return str(path)


EMPTY_GOLD = "SELECT name FROM item WHERE price > 100"


CASES = [  # (gold, prediction)
    (EMPTY_GOLD, ""),                                   # nothing: official runs "", no rows -> correct
    (EMPTY_GOLD, "-- no idea"),                         # a lone comment: the same
    (EMPTY_GOLD, "SELECT name FROM item WHERE 0"),      # an empty result
    (EMPTY_GOLD, "SELECT name FROM item"),              # rows where none are due
    (EMPTY_GOLD, "SELECT nope FROM item"),              # an error
    ("SELECT name FROM item WHERE kind = 'office'", "SELECT name FROM item WHERE kind = 'office' ORDER BY name DESC"),
    ("SELECT kind FROM item", "SELECT DISTINCT kind FROM item"),  # duplicates dropped by the set
    ("SELECT price FROM item", "SELECT price FROM item UNION ALL SELECT price FROM item"),
    ("SELECT id, name FROM item", "SELECT name, id FROM item"),   # column order counts
    ("SELECT count(*) FROM item", ENDLESS),             # a timeout
    ("SELECT count(*) FROM item", ""),                  # nothing against a non-empty gold
    ("SELECT count(*) FROM item", "SELECT 4"),
]


def test_default_rule_agrees_with_the_official_script_and_strict_does_not(db):
    qs = [Question(question_id=str(i), db_id="shop", question="q", evidence="", sql=gold, difficulty="simple",
                   db_path=db) for i, (gold, _) in enumerate(CASES)]
    preds = {str(i): pred for i, (_, pred) in enumerate(CASES)}
    official = [official_ex(db, pred, gold, 3.0) for gold, pred in CASES]
    assert official == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1]
    with SqlPool(workers=2, timeout_s=10.0, max_rows=1000, memory_mb=512, temp_store_mb=32) as pool:
        bird_rows = evaluate(qs, preds, pool, timing_runs=2)
        strict_rows = evaluate(qs, preds, pool, strict=True)
    assert [int(r["correct"]) for r in bird_rows] == official
    assert [int(r["correct"]) for r in strict_rows] == [0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1]
    assert [r["verdict"] for r in strict_rows[:2]] == ["no_sql", "sql_error"]  # the training reward's verdicts
    assert bird_rows[9]["verdict"] == "timeout"
    for r in bird_rows:
        assert (r["ves_reward"] > 0) == r["correct"]
        assert r["soft_f1"] == (1.0 if r["correct"] else r["soft_f1"])
    assert bird_rows[3]["soft_f1"] == 0.0 and bird_rows[8]["soft_f1"] == 1.0  # same values, columns swapped
    table = summary_table(bird_rows)
    assert "Soft-F1" in table and "R-VES" in table and "BIRD evaluation.py" in table
    assert f"{100 * 7 / 12:>9.2f}" in table.splitlines()[-3]

