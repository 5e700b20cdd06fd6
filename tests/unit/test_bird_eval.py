"""BIRD's scoring rules (policies/bird_eval.py) on hand-computed cases, and launch.eval's default rule
against BIRD's evaluation.py reimplemented from its definition, on a hand-made SQLite database whose
fixtures include empty golds, duplicates, row order, errors and timeouts (the sandbox bound 10 s: loose enough for a loaded
machine, where a 1 s bound timed out the golds too)."""
import sqlite3
import time

import pytest

from launch.eval import evaluate, summary_table
from policies.bird_eval import clean_times, ex_bird, soft_f1, time_ratio, ves_reward
from tasks.bird import Question
from tasks.sql_pool import SqlPool

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"


# -- hand-computed cases --------------------------------------------------------------------------

def test_ex_bird_counts_a_column_less_or_empty_answer_on_an_empty_gold():
    assert ex_bird("no_sql", [], "ok", [])
    assert ex_bird("error", [], "ok", [], "not a query: the statement returns no columns")
    assert not ex_bird("no_sql", [], "ok", [(1,)])
    assert not ex_bird("error", [], "ok", [], "no such table: t")  # did not run
    assert not ex_bird("timeout", [], "ok", [])
    assert not ex_bird("ok", [], "error", [])  # a failed gold is wrong, as the official script counts it
    assert ex_bird("ok", [(2,), (1,), (1,)], "ok", [(1,), (2,)])  # order and duplicates ignored
    assert not ex_bird("ok", [(1, 2)], "ok", [(2, 1)])  # column order is not


def test_soft_f1_hand_computed():
    assert soft_f1([], []) == 1.0
    assert soft_f1(None, [(1,)]) == 0.0
    assert soft_f1([(1, "a")], [(1, "a")]) == 1.0
    assert soft_f1([("a", 1)], [(1, "a")]) == 1.0  # values matched within a row, column order free
    # one row, 1 of 2 values right: tp 0.5, fp 0.5, fn 0.5 -> P = R = 0.5
    assert soft_f1([(1, "x")], [(1, "a")]) == pytest.approx(0.5)
    # gold two rows, prediction one matching row: tp 1, fn 1 -> P 1, R 0.5, F1 2/3
    assert soft_f1([(1,)], [(1,), (2,)]) == pytest.approx(2 / 3)
    # prediction has an extra row: tp 1, fp 1 -> F1 2/3; duplicates are dropped first
    assert soft_f1([(1,), (1,), (3,)], [(1,)]) == pytest.approx(2 / 3)
    assert soft_f1([(9,)], [(1,)]) == 0.0
    assert soft_f1([], [(1,)]) == 0.0


def test_r_ves_steps_and_time_ratio():
    assert [ves_reward(r) for r in (0, 0.1, 0.25, 0.5, 0.99, 1, 1.99, 2, 10)] == \
        [0, 0.25, 0.5, 0.75, 0.75, 1, 1, 1.25, 1.25]
    assert time_ratio([2.0, 2.0], [1.0, 1.0]) == pytest.approx(2.0)
    assert time_ratio([1.0], []) == 0.0
    many = [1.0] * 20 + [100.0]
    assert 100.0 not in clean_times(many) and len(clean_times(many)) == 20
    assert time_ratio(many, [1.0]) == pytest.approx(1.0)


# -- the official rule, reimplemented from BIRD's evaluation.py, against launch.eval ---------------

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
