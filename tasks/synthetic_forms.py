"""Value forms of tiny's synthetic task (`data.synthetic_value_forms`, issue 24 point 9): a fact about each
database that the prompt does not show and one cheap query reveals.

Each database stores the text values of its place column (city, hometown, district) and its category
column (category, department, genre, specialty) in a form of its own, per column:
- "suffix": bare (`Oslo`, as the question words it), or with a code appended (`Oslo-1`, `Oslo-2`);
- "case": Title (`Oslo`), UPPER (`OSLO`) or lower (`oslo`).
The evidence names the column but not the stored literal (`live in Oslo refers to the city column`), and
the tiny prompt shows no sample values, so a one-turn policy can only guess the form of a held-out
database's values, while an episode can look first: `SELECT DISTINCT city FROM customers WHERE city LIKE
'Oslo%'` (LIKE ignores ASCII case in SQLite; tasks.synthetic_episodes.probe) shows `Oslo-2` (or `OSLO`),
and the answer copies it. Gold SQL uses the stored form (result sets are compared). Suffix forms keep the
value's own token (a tiny tokenizer trained on the training split has every form of a suffixed value,
which case forms of values that training never asks about lack).

Invariants:
- Seeded and pure: `conventions` depends only on its arguments (string-seeded RNGs, no hashing order).
- Balanced: the training databases come in rounds (round r: the r-th instance of every domain); in each
  round the (domain, column) pairs get the forms evenly (a seeded shuffle), and from one round to the next
  every pair moves on to the next form, so with 3 rounds every value is trained in every form and
  instances of one domain (whose prompts are identical) never share a form. The held-out databases get
  their own draw: a seeded shuffle of the forms repeated evenly, per column (each form on a third, +-1).
- Off is nothing: tasks/synthetic.py calls this module only when the option is on, so its output
  with the option off is byte-identical to before.
"""
from __future__ import annotations

import random

KINDS = {"suffix": ("bare", "code1", "code2"), "case": ("title", "upper", "lower")}
COLUMNS = ("place", "cat")  # DOMAINS keys of the columns a convention covers
POOL = {"place": "places", "cat": "cats"}  # DOMAINS keys: each column's pool and table
TABLE = {"place": "entity", "cat": "item"}


def stored(form: str, value: str) -> str:
    """`value` (a pool word, Title case as the question words it) in the stored form `form`."""
    got = {"bare": value, "title": value, "code1": value + "-1", "code2": value + "-2", "upper": value.upper(),
           "lower": value.lower()}.get(form)
    if got is None:
        raise ValueError(f"unknown value form {form!r}; expected one of {[f for fs in KINDS.values() for f in fs]}")
    return got


def conventions(kind: str, seed: int, train: list[tuple[str, str]], held: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """{db_id: {column key: form}} for the training databases `train` and the held-out ones `held`, each
    given as (db_id, domain name) in build order; `kind` one of KINDS."""
    if kind not in KINDS:
        raise ValueError(f"unknown value-form kind {kind!r}; expected one of {sorted(KINDS)}")
    forms = KINDS[kind]
    rounds: dict[str, int] = {}
    placed = []
    for db_id, domain in train:
        rounds[domain] = rounds.get(domain, -1) + 1
        placed.append((db_id, domain, rounds[domain]))
    pairs = sorted({(domain, col) for _, domain, _ in placed for col in COLUMNS})
    base = [i % len(forms) for i in range(len(pairs))]
    random.Random(f"{seed}:forms:{kind}:train").shuffle(base)
    start = dict(zip(pairs, base))
    out: dict[str, dict[str, str]] = {db_id: {col: forms[(start[domain, col] + r) % len(forms)] for col in COLUMNS}
                                      for db_id, domain, r in placed}
    for col in COLUMNS:
        drawn = [forms[i % len(forms)] for i in range(len(held))]
        random.Random(f"{seed}:forms:{kind}:held:{col}").shuffle(drawn)
        for (db_id, _), form in zip(held, drawn):
            out.setdefault(db_id, {})[col] = form
    return out


def forms_template(sql: str, evidence: str) -> tuple[str, str]:
    """A template's (gold SQL, evidence) under the option: the SQL's place and category literals take
    their stored form (slots v_place_s / v_cat_s), and the evidence names the column instead of the literal."""
    for col in COLUMNS:
        sql = sql.replace(f"'{{v_{col}}}'", f"'{{v_{col}_s}}'")
        evidence = evidence.replace(f"{{{col}}} = '{{v_{col}}}'", f"the {{{col}}} column")
    return sql, evidence


def stored_slots(slots: dict, forms: dict[str, str]) -> dict:
    """The stored forms of a question's place and category values, as the slots forms_template's SQL uses."""
    return {f"v_{col}_s": stored(forms[col], slots[f"v_{col}"]) for col in COLUMNS}
