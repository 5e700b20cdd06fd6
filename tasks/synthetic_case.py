"""Value conventions of tiny's synthetic task (`data.synthetic_value_case`, issue 24 point 9): a fact about
each database that the prompt does not show and one cheap query reveals.

Each database stores the text values of its place column (city, hometown, district) and its category
column (category, department, genre, specialty) in one form of its own, per column: UPPER (`OSLO`),
lower (`oslo`) or Title (`Oslo`, the form the question uses). The evidence names the column but not the
stored literal (`live in Oslo refers to the city column`), and the tiny prompt shows no sample values,
so a one-turn policy can only guess the form of a held-out database's values, while an episode can look
first: `SELECT DISTINCT city FROM customers WHERE city LIKE 'Oslo'` (LIKE ignores ASCII case in SQLite;
tasks.synthetic_episodes.probe) shows `OSLO`, and the answer copies it. Gold SQL uses the stored form (result sets are compared).

Invariants:
- Seeded and pure: `conventions` depends only on its arguments (string-seeded RNGs, no hashing order).
- Balanced: among the training databases, the instances of one domain get the forms of a seeded
  permutation in turn, per column, so with 3 instances per domain every value appears in every form
  in training (the tokenizer and the model see each form); the held-out databases get their own draw, a
  seeded shuffle of the forms repeated evenly, per column (each form on a third of them, +-1).
- Off is nothing: tasks/synthetic.py calls this module only when the option is on, so its output
  with the option off is byte-identical to before.
"""
from __future__ import annotations

import random

FORMS = ("upper", "lower", "title")
COLUMNS = ("place", "cat")  # DOMAINS keys of the columns a convention covers; their pools: places, cats
POOL = {"place": "places", "cat": "cats"}  # DOMAINS keys: each column's pool and table
TABLE = {"place": "entity", "cat": "item"}


def stored(form: str, value: str) -> str:
    """`value` (a pool word, Title case as the question says it) in the stored form `form`."""
    if form == "upper":
        return value.upper()
    if form == "lower":
        return value.lower()
    if form == "title":
        return value
    raise ValueError(f"unknown value form {form!r}; expected one of {FORMS}")


def conventions(seed: int, train: list[tuple[str, str]], held: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """{db_id: {column key: form}} for the training databases `train` and the held-out ones `held`,
    each given as (db_id, domain name) in build order."""
    out: dict[str, dict[str, str]] = {}
    seen: dict[str, int] = {}
    for db_id, domain in train:
        r = seen[domain] = seen.get(domain, -1) + 1
        out[db_id] = {}
        for col in COLUMNS:
            perm = list(FORMS)
            random.Random(f"{seed}:case:{domain}:{col}").shuffle(perm)
            out[db_id][col] = perm[r % len(perm)]
    for col in COLUMNS:
        forms = [FORMS[i % len(FORMS)] for i in range(len(held))]
        random.Random(f"{seed}:case:held:{col}").shuffle(forms)
        for (db_id, _), form in zip(held, forms):
            out.setdefault(db_id, {})[col] = form
    return out


def case_template(sql: str, evidence: str) -> tuple[str, str]:
    """A template's (gold SQL, evidence) under the option: the SQL's place and category literals take
    their stored form (slots v_place_s / v_cat_s), and the evidence names the column instead of the literal."""
    for col in COLUMNS:
        sql = sql.replace(f"'{{v_{col}}}'", f"'{{v_{col}_s}}'")
        evidence = evidence.replace(f"{{{col}}} = '{{v_{col}}}'", f"the {{{col}}} column")
    return sql, evidence


def stored_slots(slots: dict, case: dict[str, str]) -> dict:
    """The stored forms of a question's place and category values, as the slots case_template's SQL uses."""
    return {f"v_{col}_s": stored(case[col], slots[f"v_{col}"]) for col in COLUMNS}
