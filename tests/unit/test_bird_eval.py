"""BIRD's scoring rules (policies/bird_eval.py) on hand-computed cases, and launch.eval's default rule
against BIRD's evaluation.py reimplemented from its definition, on a hand-made SQLite database whose
fixtures include empty golds, duplicates, row order, errors and timeouts (the sandbox bound 10 s: loose enough for a loaded
machine, where a 1 s bound timed out the golds too)."""

import pytest

from policies.bird_eval import clean_times, ex_bird, soft_f1, time_ratio, ves_reward

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

