"""The text-to-SQL reward: SQL extraction, BIRD's result comparison, verdict -> reward.

Invariants:
- Pure functions, no IO: the sandbox executes, this module only judges.
- Every sample gets exactly one verdict from VERDICTS, and its reward is `reward_for(verdict)`:
  1.0 for a match, 0.1 for SQL that ran but returned different rows, 0.0 for everything else.
  `shaped_reward` adds the weighted partial terms (scorer.reward_syntax / reward_schema_linking /
  reward_format, all 0 by default: then it is reward_for exactly); a wrong answer never outscores a
  right one, whatever the weights.
- Result comparison is BIRD's rule, set(pred_rows) == set(gold_rows): row order and duplicate
  rows are ignored, column order is not (rows are tuples). It is stricter than BIRD's evaluation.py
  on purpose: an answer with no SQL or no result columns is never a match, even against an empty gold
  (BIRD's script counts it; paying for it would teach the policy to answer nothing). launch.eval scores
  with BIRD's rule by default (policies/bird_eval.py) and with this one under --strict.
"""
from __future__ import annotations

import re
from typing import Iterable

MATCH = "match"
WRONG_RESULT = "wrong_result"
SQL_ERROR = "sql_error"
TIMEOUT = "timeout"
NO_SQL = "no_sql"
TOO_MANY_ROWS = "too_many_rows"
GOLD_FAILED = "gold_failed"
GENERATION_ERROR = "generation_error"
BAD_DB_PATH = "bad_db_path"  # the task names a database outside the configured data directory

VERDICTS = (MATCH, WRONG_RESULT, SQL_ERROR, TIMEOUT, NO_SQL, TOO_MANY_ROWS, GOLD_FAILED, GENERATION_ERROR, BAD_DB_PATH)

_REWARDS = {MATCH: 1.0, WRONG_RESULT: 0.1}

# ```sql ... ``` (language tag case-insensitive); an unterminated last block runs to the end.
_SQL_FENCE = re.compile(r"```[ \t]*sql[ \t]*\r?\n?(.*?)(?:```|\Z)", re.IGNORECASE | re.DOTALL)
_ANY_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n?(.*?)(?:```|\Z)", re.DOTALL)
_SQL_START = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)
_SQL_LABEL = re.compile(r"^\s*SQL\s*:\s*", re.IGNORECASE)


def reward_for(verdict: str) -> float:
    """1.0 match, 0.1 executed-but-wrong, 0.0 otherwise (unknown verdicts are refused)."""
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r}; expected one of {', '.join(VERDICTS)}")
    return _REWARDS.get(verdict, 0.0)


def _clean(sql: str) -> str | None:
    sql = sql.strip()
    # One statement only: drop a trailing semicolon (and anything after a first full statement
    # is left for SQLite to refuse, so "SELECT 1; DROP ..." is an error, not a silent cut).
    while sql.endswith(";"):
        sql = sql[:-1].rstrip()
    return sql or None


def extract_sql(text: str) -> str | None:
    """The SQL a completion answers with, or None when it has none.

    Order of preference, all looking only after the last </think> when there is one:
    1. the last ```sql fenced block;
    2. the last fenced block of no language whose body starts like a query;
    3. a bare query: "SQL: ..." or text from the last line that starts with SELECT/WITH.
    Text inside an unclosed <think> (the model ran out of tokens while reasoning) has no answer.
    """
    if not text:
        return None
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None  # still reasoning: whatever SQL is in there is a draft, not an answer
    blocks = _SQL_FENCE.findall(text)
    for body in reversed(blocks):
        sql = _clean(body)
        if sql:
            return sql
    for lang, body in reversed(_ANY_FENCE.findall(text)):
        if lang == "" and _SQL_START.match(body.strip()):
            sql = _clean(body)
            if sql:
                return sql
    if "```" in text:
        return None  # fenced but not SQL (e.g. ```python): do not guess from prose
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = _SQL_LABEL.sub("", lines[i]) if _SQL_LABEL.match(lines[i]) else lines[i]
        if _SQL_START.match(line.strip()):
            return _clean("\n".join([line] + lines[i + 1 :]))
    return None


def compare_results(pred_rows: Iterable[tuple], gold_rows: Iterable[tuple]) -> bool:
    """BIRD's execution match: the two results are equal as sets of row tuples."""
    return set(map(tuple, pred_rows)) == set(map(tuple, gold_rows))


def verdict_for(pred_status: str, pred_rows, gold_status: str, gold_rows) -> str:
    """Combines two execution outcomes (sandbox statuses) into one verdict.

    Statuses: "ok" | "error" | "timeout" | "too_many_rows" | "no_sql" (nothing to run).
    A gold that did not run cleanly makes the sample "gold_failed" whatever it predicted.
    """
    if gold_status != "ok":
        return GOLD_FAILED
    if pred_status == "no_sql":
        return NO_SQL
    if pred_status == "ok":
        return MATCH if compare_results(pred_rows, gold_rows) else WRONG_RESULT
    return {"error": SQL_ERROR, "timeout": TIMEOUT, "too_many_rows": TOO_MANY_ROWS}.get(pred_status, SQL_ERROR)


# ---------------------------------------------------------------- partial reward terms (scorer.reward_*)
# Syntax validity and schema linking (Reasoning-SQL, arXiv 2503.23157; Think2SQL, arXiv 2504.15077) and a
# format term. Guard: a MATCH earns every term at its maximum, so no wrong answer (base <= 0.1 plus terms)
# outscores a right one (base 1.0 plus the same maxima). With every weight 0 the reward is reward_for's.
_PARSED = (MATCH, WRONG_RESULT, TOO_MANY_ROWS, TIMEOUT)  # SQLite accepted the statement
_STRING = re.compile(r"'(?:[^']|'')*'")
_IDENT = re.compile(r'"([^"]+)"|`([^`]+)`|\[([^\]]+)\]|\b([A-Za-z_][A-Za-z0-9_]*)\b')
_SQL_WORDS = frozenset("""select from where and or not in is null like between join inner left right outer full
cross on using group by order having limit offset as distinct all union intersect except case when then else end
asc desc with exists cast count sum avg min max round abs length substr substring upper lower ifnull coalesce
strftime date datetime julianday iif instr replace trim integer real text over partition glob escape collate
nocase true false recursive values natural""".split())


def sql_identifiers(sql: str) -> set[str]:
    """The lower-cased names an SQL statement uses (tables, columns, aliases): quoted names kept whole,
    string literals and SQL keywords / common functions dropped."""
    names = set()
    for m in _IDENT.finditer(_STRING.sub(" ", sql)):
        quoted = m.group(1) or m.group(2) or m.group(3)
        word = (quoted or m.group(4)).lower()
        if quoted or word not in _SQL_WORDS:
            names.add(word)
    return names


def schema_linking_f1(pred_sql: str | None, gold_sql: str) -> float:
    """F1 of the names the predicted SQL uses against those the gold SQL uses (0 without a prediction)."""
    if not pred_sql:
        return 0.0
    pred, gold = sql_identifiers(pred_sql), sql_identifiers(gold_sql)
    hit = len(pred & gold)
    return 0.0 if not hit else 2 * hit / (len(pred) + len(gold))


def shaped_reward(verdict: str, text: str, pred_sql: str | None, gold_sql: str, syntax: float = 0.0,
                  schema: float = 0.0, fmt: float = 0.0) -> float:
    """reward_for(verdict) + syntax [the SQL parsed] + schema F1(names) + fmt [a ```sql block], each term
    times its weight; a MATCH gets every term at 1 (the guard above)."""
    base = reward_for(verdict)
    if verdict == MATCH:
        return base + syntax + schema + fmt
    return (base + syntax * (verdict in _PARSED) + schema * schema_linking_f1(pred_sql, gold_sql)
            + fmt * (_SQL_FENCE.search(text or "") is not None))
