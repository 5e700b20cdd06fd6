"""Partial reward terms (policies/sql_reward.shaped_reward, scorer.reward_*): hand values, today's
rewards exactly when off, a wrong answer never above a right one over every combination, and the real
scorer on a synthetic SQLite database."""
import itertools

import pytest

from config import ConfigError, ScorerConfig
from config.validate import validate
from policies.sql_reward import MATCH, VERDICTS, reward_for, schema_linking_f1, shaped_reward, sql_identifiers

GOLD = "SELECT T1.name FROM users AS T1 JOIN orders AS T2 ON T1.id = T2.user_id WHERE T2.total > 'big'"


def test_identifiers_and_schema_linking_f1_by_hand():
    assert sql_identifiers(GOLD) == {"t1", "name", "users", "t2", "orders", "id", "user_id", "total"}
    assert sql_identifiers('SELECT "first name", [x] FROM `t` WHERE a = \'users\'') == {"first name", "x", "t", "a"}
    # pred names {name, users}: 2 hits, F1 = 2*2 / (2 + 8)
    assert schema_linking_f1("SELECT name FROM users", GOLD) == pytest.approx(0.4)
    assert schema_linking_f1(GOLD, GOLD) == 1.0
    assert schema_linking_f1(None, GOLD) == 0.0 and schema_linking_f1("SELECT 1", GOLD) == 0.0


def test_off_by_default_is_todays_reward_exactly():
    for v in VERDICTS:
        assert shaped_reward(v, "```sql\nSELECT name FROM users\n```", "SELECT name FROM users", GOLD) == reward_for(v)
    cfg = ScorerConfig()
    assert (cfg.reward_syntax, cfg.reward_schema_linking, cfg.reward_format) == (0.0, 0.0, 0.0)


def test_a_wrong_answer_never_outscores_a_right_one():
    texts = ["```sql\nSELECT name FROM users\n```", "SELECT name FROM users", "no sql here"]
    preds = [None, "SELECT 1", "SELECT name FROM users", GOLD]
    for weights in itertools.product((0.0, 0.3, 1.0), repeat=3):
        best_wrong = max(shaped_reward(v, t, p, GOLD, *weights)
                         for v in VERDICTS if v != MATCH for t in texts for p in preds)
        worst_right = min(shaped_reward(MATCH, t, p, GOLD, *weights) for t in texts for p in preds)
        assert best_wrong < worst_right, weights


def test_each_term_by_hand():
    pred = "SELECT name FROM users"
    fenced = f"```sql\n{pred}\n```"
    assert shaped_reward("wrong_result", fenced, pred, GOLD, syntax=0.2) == pytest.approx(0.3)
    assert shaped_reward("sql_error", fenced, pred, GOLD, syntax=0.2) == 0.0  # did not parse
    assert shaped_reward("sql_error", fenced, pred, GOLD, schema=0.5) == pytest.approx(0.2)
    assert shaped_reward("sql_error", fenced, pred, GOLD, fmt=0.1) == pytest.approx(0.1)
    assert shaped_reward("sql_error", pred, pred, GOLD, fmt=0.1) == 0.0  # no ```sql block
    assert shaped_reward(MATCH, pred, pred, GOLD, 0.2, 0.5, 0.1) == pytest.approx(1.8)


def test_config_weights_are_checked_in_one_line():
    assert validate({"scorer": {"reward_syntax": 0.1, "reward_format": 1.0}}).scorer.reward_syntax == 0.1
    for key in ("reward_syntax", "reward_schema_linking", "reward_format"):
        for bad in (-0.1, 1.5):
            with pytest.raises(ConfigError, match=f"scorer.{key}") as e:
                validate({"scorer": {key: bad}})
            assert "\n" not in str(e.value)


