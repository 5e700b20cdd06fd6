"""The multi-turn version of tiny's synthetic task: warm-start episodes in which an observation reveals a
slip and the model fixes it (issue 24, point 9; the protocol is policies/episode.py).

An error-then-fix episode is

    <sql>{the answer with one identifier misspelt}</sql>          (the model's ids, loss mask 1)
    <observation> error: no such column: nmae </observation>      (executed for real; mask 0)
     {the answer} <eos>                                            (mask 1)

or, with kind="value" (a share `model.tiny_sft_value_slips` of them), an empty-then-fix episode whose
first query misspells a quoted value, so it runs and shows no rows (or a 0 / NULL aggregate):

    <sql>SELECT COUNT(*) FROM customer WHERE city = 'Prais'</sql>
    <observation> COUNT(*)\n0\n(1 row) </observation>
     {the answer} <eos>

or, with kind="revise" (a share `model.tiny_sft_revise` of them), a look-then-fix episode whose first
query is the one-shot warm start's own draw (the template's slip with probability `model.tiny_sft_slip`,
else the gold SQL), run for real, and whose answer is always the gold SQL: the model learns to try its
first guess, see what it returns, and then answer right (after a gold first query the answer repeats it):

    <sql>SELECT item_id FROM item WHERE genre = 'Poetry'</sql>   (the slip: ids where names were asked)
    <observation> item_id\n4\n17\n(2 rows) </observation>
     SELECT name FROM item WHERE genre = 'Poetry' <eos>

or, with kind="look" (a share `model.tiny_sft_look` of them, on data.synthetic_value_forms's task), a
look-then-answer episode: the first query shows how the question's value is stored in this database
(`probe`), run for real, and the answer (the one-shot draw, in the stored form) follows:

    <sql>SELECT DISTINCT city FROM customers WHERE city LIKE 'Oslo'</sql>
    <observation> city\nOSLO\n(1 row) </observation>
     SELECT COUNT(*) FROM customers WHERE city = 'OSLO' <eos>

and a direct episode is just " {the answer} <eos>" (one turn), where the answer is the gold SQL or, with
`model.tiny_sft_slip`, its template's slip, exactly as the one-shot warm start draws it (so the final
answers of both warm starts have the same mixture: only the chance to see an error and retry differs).

Invariants:
- Token ids are built by concatenation, never by re-tokenizing the episode: the tool block and the
  answer are tokenized as the model would have sampled them, the observation alone
  (policies.episode.observation_ids), so the warm start teaches exactly the ids the generator builds.
- The observation is the real result (of a revise episode's first query too: a first query that
  errors or times out shows its error) of running the misspelt query read-only on the example's own
  database (tasks/sandbox.execute_readonly); a misspelt name that still runs, or a misspelt value
  whose query errors or returns the answer's own rows, is not used.
- Pure given its inputs and `rng`; only training prompts are used.
"""
from __future__ import annotations

import random
import re

from policies import episode as ep
from tasks.synthetic_forms import COLUMNS, POOL, TABLE
from tasks.synthetic_text import DOMAINS

_IDENT = re.compile(r"\b([A-Za-z_][A-Za-z_]{3,})\b")
_KEYWORDS = {"SELECT", "FROM", "WHERE", "GROUP", "ORDER", "LIMIT", "INNER", "JOIN", "COUNT", "DISTINCT", "HAVING",
             "STRFTIME", "DESC", "BETWEEN", "LIKE", "CAST", "REAL", "AVG", "SUM", "MIN", "MAX", "ASC", "UNION"}


_VALUE = re.compile(r"'([A-Za-z]{3,})'")
KINDS = ("identifier", "value", "revise", "look")


def _swap(sql: str, span: tuple[int, int], rng: random.Random) -> str | None:
    """`sql` with two neighbouring letters of sql[span] swapped (never its first or last), or None when
    the swap changes nothing."""
    a, b = span
    word = sql[a:b]
    i = rng.randrange(1, len(word) - 1)
    swapped = word[:i - 1] + word[i] + word[i - 1] + word[i + 1:]
    return None if swapped == word else sql[:a] + swapped + sql[b:]


def misspelt(sql: str, rng: random.Random) -> str | None:
    """`sql` with one table or column name misspelt (two letters swapped), or None when it has none.
    Quoted values are left alone."""
    unquoted = re.sub(r"'[^']*'", lambda m: " " * len(m.group()), sql)
    spans = [m.span(1) for m in _IDENT.finditer(unquoted) if m.group(1).upper() not in _KEYWORDS]
    return _swap(sql, rng.choice(spans), rng) if spans else None


def misspelt_value(sql: str, rng: random.Random) -> str | None:
    """`sql` with one quoted word value misspelt (two letters swapped), or None when it has none: the
    query still runs, and its filter matches nothing. Names and keywords are left alone."""
    spans = [m.span(1) for m in _VALUE.finditer(sql)]
    return _swap(sql, rng.choice(spans), rng) if spans else None


def encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _episode(tokenizer, first: str, result, final: list[int], max_observation_tokens: int) -> tuple[list[int], list[int]]:
    """<sql>first</sql> + its observation (mask 0) + the final answer's ids."""
    call = encode(tokenizer, ep.TOOL_OPEN + first + ep.TOOL_CLOSE)
    obs = ep.observation_ids(tokenizer, ep.observation_text(result.status, result.columns, result.rows, result.error),
                             max_observation_tokens)
    return call + obs + final, [1] * len(call) + [0] * len(obs) + [1] * len(final)


def revise_target(tokenizer, first: str, gold: str, db_path: str, max_observation_tokens: int) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of a look-then-fix episode: `first` (the one-shot draw: the template's slip
    or the gold SQL) as a query, its real rows (or error) as the observation, then `gold` as the answer."""
    from tasks.sandbox import execute_readonly

    final = encode(tokenizer, " " + gold) + [tokenizer.eos_token_id]
    result = execute_readonly(db_path, first, timeout_s=5.0, max_rows=1000)
    return _episode(tokenizer, first, result, final, max_observation_tokens)


_LITERAL = re.compile(r"(?:\bT\d\.)?(\w+) = '([^']*)'")


def probe(sql: str) -> str | None:
    """A query that shows how `sql`'s first place or category literal is stored: `SELECT DISTINCT city FROM
    customers WHERE city LIKE 'Oslo%'` (the value as the question words it; LIKE ignores case, and no pool
    word begins another of its pool), or None when `sql` compares no such column with a literal."""
    for m in _LITERAL.finditer(sql):
        column, value = m.groups()
        for d in DOMAINS:
            for col in COLUMNS:
                if d[col] != column or not re.search(rf"\b{d[TABLE[col]]}\b", sql):
                    continue  # another domain's column of that name (city: retail and clinic)
                bare = re.sub(r"-\d+\Z", "", value).lower()  # a suffix form's code off
                word = next((w for w in d[POOL[col]] if w.lower() == bare), None)
                if word is not None:
                    table = d[TABLE[col]]
                    return f"SELECT DISTINCT {column} FROM {table} WHERE {column} LIKE '{word}%'"
    return None


def look_target(tokenizer, answer: str, gold: str, db_path: str, max_observation_tokens: int) -> tuple[list[int], list[int]] | None:
    """(response ids, loss mask) of a look-then-answer episode: the probe of `gold`'s place or category value
    (`probe`), its real rows as the observation, then `answer`; None when `gold` compares
    no such value (then there is nothing to look up)."""
    from tasks.sandbox import execute_readonly

    first = probe(gold)
    if first is None:
        return None
    final = encode(tokenizer, " " + answer) + [tokenizer.eos_token_id]
    result = execute_readonly(db_path, first, timeout_s=5.0, max_rows=1000)
    return _episode(tokenizer, first, result, final, max_observation_tokens)


def episode_target(tokenizer, answer: str, db_path: str, rng: random.Random, max_observation_tokens: int,
                   error_first: bool, kind: str = "identifier") -> tuple[list[int], list[int]] | None:
    """(response ids, loss mask) of one warm-start episode answering `answer`: with `error_first`, a
    slip-then-fix episode whose first query misspells a name (kind "identifier": it errors) or a quoted
    value (kind "value": it runs and returns other rows than `answer`, as a rule none), None when no such
    misspelling of `answer` exists; else the direct answer."""
    from tasks.sandbox import execute_readonly

    if kind not in KINDS[:2]:
        raise ValueError(f"episode_target: kind must be one of {KINDS[:2]} (revise: revise_target), got {kind!r}")
    final = encode(tokenizer, " " + answer) + [tokenizer.eos_token_id]
    if not error_first:
        return final, [1] * len(final)
    bad = (misspelt if kind == "identifier" else misspelt_value)(answer, rng)
    if bad is None:
        return None
    result = execute_readonly(db_path, bad, timeout_s=5.0, max_rows=1000)
    if kind == "identifier" and result.status == "ok":
        return None  # the misspelling ran (an alias, say): no error to reveal
    if kind == "value":
        if result.status != "ok":
            return None
        right = execute_readonly(db_path, answer, timeout_s=5.0, max_rows=1000)
        if right.status == "ok" and sorted(map(repr, right.rows)) == sorted(map(repr, result.rows)):
            return None  # the misspelt value changes nothing visible: nothing to fix
    return _episode(tokenizer, bad, result, final, max_observation_tokens)
