"""BIRD's own scoring rules, from their published definitions: EX, Soft-F1 and R-VES.

EX (BIRD's evaluation.py): a question is correct when the prediction runs and
set(pred_rows) == set(gold_rows). Because that is all the official script checks, a prediction that
runs and returns no rows (an empty string, a lone comment, a statement with no result columns) is
correct whenever the gold returns no rows. `launch.eval` scores this way by default so its numbers
compare with the leaderboard's; `--strict` scores with the training reward's rule instead
(policies/sql_reward.verdict_for: such a prediction is `no_sql` or `sql_error`, never a match), and the
training reward stays strict because paying for an empty statement invites reward hacking.

Soft-F1 (BIRD mini-dev's evaluation_f1.py): both results are deduplicated, rows are paired by position,
and each pair scores per value: matched values (a prediction value found in the gold row) are true
positives, prediction-only values false positives, gold-only values false negatives, each divided by
the gold row's width; unpaired gold rows are a false negative of 1, unpaired prediction rows a false
positive of 1. Two empty results score 1.0, a prediction that did not run 0.0. The official code pairs
rows in Python set order (which depends on string hashing); here rows keep their first-occurrence
order, so the score is deterministic.

R-VES (BIRD mini-dev's evaluation_ves.py): for a question whose EX is correct, the time ratio
gold_seconds / pred_seconds (each the mean over repeated runs after dropping values beyond 3 standard
deviations) earns 1.25 (ratio >= 2), 1 (>= 1), 0.75 (>= 0.5), 0.5 (>= 0.25) or 0.25 (> 0); a wrong
question earns 0. R-VES is 100 x the mean reward.

Known difference from the official scripts: the sandbox never runs a write, so a write statement
(`DELETE ... WHERE 0`) is an error here even where the official script would run it and count it.

Invariants: pure functions over execution outcomes (sandbox statuses, rows, seconds), no IO.
"""
from __future__ import annotations

import statistics
from typing import Sequence

# The sandbox's error for a statement that ran but has no result columns (tasks/sandbox.py).
NO_COLUMNS = "not a query: the statement returns no columns"


def bird_outcome(status: str, rows: Sequence, error: str = "") -> tuple[bool, list]:
    """(ran, rows) as BIRD's script sees a prediction: nothing to run and a statement without result
    columns both ran and returned no rows; every other non-ok status did not run."""
    if status == "no_sql" or (status == "error" and error.startswith(NO_COLUMNS)):
        return True, []
    return status == "ok", list(rows) if status == "ok" else []


def ex_bird(pred_status: str, pred_rows: Sequence, gold_status: str, gold_rows: Sequence,
            pred_error: str = "") -> bool:
    """BIRD's EX: both ran and their results are equal as sets of row tuples."""
    if gold_status != "ok":
        return False
    ran, rows = bird_outcome(pred_status, pred_rows, pred_error)
    return ran and set(map(tuple, rows)) == set(map(tuple, gold_rows))


def _dedup(rows: Sequence) -> list[tuple]:
    return list(dict.fromkeys(map(tuple, rows)))


def _row_match(pred_row: tuple, gold_row: tuple) -> tuple[float, float, float]:
    width = len(gold_row)
    if width == 0:
        return 0.0, float(len(pred_row) > 0), 0.0
    matches = sum(1 for v in pred_row if v in gold_row)
    pred_only = len(pred_row) - matches
    gold_only = sum(1 for v in gold_row if v not in pred_row)
    return matches / width, pred_only / width, gold_only / width


def soft_f1(pred_rows: Sequence | None, gold_rows: Sequence) -> float:
    """BIRD mini-dev's Soft-F1 of one question; `pred_rows` None means the prediction did not run."""
    if pred_rows is None:
        return 0.0
    pred, gold = _dedup(pred_rows), _dedup(gold_rows)
    if not pred and not gold:
        return 1.0
    tp = fp = fn = 0.0
    for i, gold_row in enumerate(gold):
        if i >= len(pred):
            fn += 1
            continue
        m, p, g = _row_match(pred[i], gold_row)
        tp, fp, fn = tp + m, fp + p, fn + g
    fp += max(0, len(pred) - len(gold))
    precision = tp / (tp + fp) if tp + fp > 0 else 0.0
    recall = tp / (tp + fn) if tp + fn > 0 else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def clean_times(seconds: Sequence[float]) -> list[float]:
    """The runs within 3 standard deviations of the mean (all of them when fewer than 2)."""
    if len(seconds) < 2:
        return list(seconds)
    mean, sd = statistics.fmean(seconds), statistics.pstdev(seconds)
    return [s for s in seconds if mean - 3 * sd <= s <= mean + 3 * sd]


def time_ratio(gold_seconds: Sequence[float], pred_seconds: Sequence[float]) -> float:
    """gold / prediction mean time after cleaning; 0 when either has no runs."""
    gold, pred = clean_times(gold_seconds), clean_times(pred_seconds)
    if not gold or not pred:
        return 0.0
    return statistics.fmean(gold) / max(statistics.fmean(pred), 1e-9)


def ves_reward(ratio: float) -> float:
    """R-VES's step reward of one correct question's time ratio (0 for a wrong one: ratio 0)."""
    if ratio <= 0:
        return 0.0
    if ratio >= 2:
        return 1.25
    if ratio >= 1:
        return 1.0
    if ratio >= 0.5:
        return 0.75
    if ratio >= 0.25:
        return 0.5
    return 0.25
