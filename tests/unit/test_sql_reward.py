"""SQL extraction and BIRD's result comparison (pure functions, no IO)."""
import math

import pytest

from policies.sql_reward import (
    BAD_DB_PATH,
    GENERATION_ERROR,
    GOLD_FAILED,
    MATCH,
    NO_SQL,
    SQL_ERROR,
    TIMEOUT,
    TOO_MANY_ROWS,
    VERDICTS,
    WRONG_RESULT,
    compare_results,
    extract_sql,
    reward_for,
    verdict_for,
)


@pytest.mark.parametrize("text, expected", [
    ("<think>draft ```sql\nSELECT 0\n```</think>\n```sql\nSELECT 1;\n```", "SELECT 1"),
    ("```sql\nSELECT a FROM t\n```\nbetter:\n```sql\nSELECT b FROM t\n```", "SELECT b FROM t"),
    ("<think>x</think>```SQL\nselect 2\n```", "select 2"),
    ("</think>\n```sql\nSELECT 3\nFROM t", "SELECT 3\nFROM t"),  # unterminated last block
    ("</think>\n```\nSELECT 4 FROM t\n```", "SELECT 4 FROM t"),  # untagged fence that is SQL
    ("The answer is:\nSELECT 5 FROM t WHERE x = 1;", "SELECT 5 FROM t WHERE x = 1"),
    ("SQL: SELECT 6", "SELECT 6"),
    ("WITH c AS (SELECT 1) SELECT * FROM c", "WITH c AS (SELECT 1) SELECT * FROM c"),
    ("```sql\nSELECT 1; DROP TABLE t;\n```", "SELECT 1; DROP TABLE t"),  # left for SQLite to refuse
])
def test_extract_sql_finds_the_final_query(text, expected):
    assert extract_sql(text) == expected


@pytest.mark.parametrize("text", [
    "", "I do not know.", "<think>SELECT 1 FROM t is my idea but I ran out of",  # unclosed think
    "</think>```python\nprint('SELECT 1')\n```", "</think>```sql\n\n```", "<think>```sql\nSELECT 1\n```</think> no answer",
])
def test_extract_sql_returns_none_without_an_answer(text):
    assert extract_sql(text) is None


def test_compare_ignores_row_order_and_duplicates_but_not_column_order():
    assert compare_results([(1, "a"), (2, "b")], [(2, "b"), (1, "a")])
    assert compare_results([(1, "a"), (1, "a")], [(1, "a")])
    assert not compare_results([("a", 1)], [(1, "a")])
    assert not compare_results([(1,)], [(1, "a")])


def test_compare_empty_nulls_and_floats():
    assert compare_results([], [])
    assert not compare_results([], [(None,)])
    assert compare_results([(None, 1)], [(None, 1)])
    assert not compare_results([(None,)], [(0,)])
    assert compare_results([(1,)], [(1.0,)])  # Python equality, as BIRD's evaluator uses
    assert not compare_results([(0.1 + 0.2,)], [(0.3,)])  # no tolerance: BIRD compares exactly
    assert compare_results([(float("inf"),)], [(math.inf,)])


def test_rewards_per_verdict():
    assert reward_for(MATCH) == 1.0
    assert reward_for(WRONG_RESULT) == 0.1
    for v in (SQL_ERROR, TIMEOUT, NO_SQL, TOO_MANY_ROWS, GOLD_FAILED, GENERATION_ERROR, BAD_DB_PATH):
        assert reward_for(v) == 0.0
    assert set(VERDICTS) == {MATCH, WRONG_RESULT, SQL_ERROR, TIMEOUT, NO_SQL, TOO_MANY_ROWS, GOLD_FAILED, GENERATION_ERROR,
                             BAD_DB_PATH}
    with pytest.raises(ValueError, match="unknown verdict 'great'"):
        reward_for("great")


@pytest.mark.parametrize("pred, gold, verdict", [
    (("ok", [(1,)]), ("ok", [(1,)]), MATCH),
    (("ok", [(2,)]), ("ok", [(1,)]), WRONG_RESULT),
    (("error", []), ("ok", [(1,)]), SQL_ERROR),
    (("timeout", []), ("ok", [(1,)]), TIMEOUT),
    (("too_many_rows", []), ("ok", [(1,)]), TOO_MANY_ROWS),
    (("no_sql", []), ("ok", [(1,)]), NO_SQL),
    (("ok", [(1,)]), ("timeout", []), GOLD_FAILED),
    (("ok", []), ("error", []), GOLD_FAILED),
])
def test_verdict_combines_both_executions(pred, gold, verdict):
    assert verdict_for(pred[0], pred[1], gold[0], gold[1]) == verdict
