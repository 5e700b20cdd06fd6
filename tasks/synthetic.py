"""A deterministic, BIRD-layout synthetic text-to-SQL dataset (for tiny runs, tests, benchmarks).

Invariants:
- Same arguments, same bytes of train.json / dev.json (one seeded RNG per database and one for
  the questions; nothing depends on time, hashing order or the filesystem).
- The output is exactly BIRD's layout, so tasks.bird.load_split reads it with no special case:
  <split>.json, <split>_databases/<db_id>/<db_id>.sqlite, .../database_description/<table>.csv.
- Every gold query runs and is phrased from a small set of templates (tasks/synthetic_text.py: the
  domains, the templates and their slips) whose slots are filled with values that exist in the
  database, so a tiny model can learn the mapping.
- With held-out databases, no dev question text (with its evidence) is ever a train question's, and
  dev questions are asked on databases train never uses.
- `value_forms` (off by default) gives each database a stored form of its place and category values
  (tasks/synthetic_forms.py); off, nothing of it runs and the bytes are those of before. `domains` (default
  all) is how many DOMAINS the databases cycle through; all of them is the behaviour of before.
- `value_pool` (off by default) names each database's places and categories with made-up words of its own
  (tasks/synthetic_pool.py), so no two databases share a value; off, the bytes are those of before.
"""
from __future__ import annotations

import csv
import json
import os
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Iterator

# the task's words; SLIPS, TINY_TEMPLATES, slipped and template_of are re-exported for callers of this module
from tasks.synthetic_text import (  # noqa: F401
    DOMAINS,
    FIRST_NAMES,
    LAST_NAMES,
    SLIPS,
    TEMPLATES,
    TINY_TEMPLATES,
    slipped,
    template_of,
)

_FACT_YEARS = (2019, 2024)


def _domain_for(index: int, domains: int = len(DOMAINS)) -> tuple[str, dict]:
    d = DOMAINS[index % domains]
    rnd = index // domains
    return (d["domain"] if rnd == 0 else f"{d['domain']}_{rnd + 1}"), d


def _build_database(path: Path, d: dict, rng: random.Random, scale: int, forms: dict | None = None) -> dict:
    """Writes one SQLite database and returns the values the question slots draw from (as the question
    words them; with `forms` (tasks/synthetic_forms.py), the place and category values are stored so)."""
    n_entity, n_item, n_fact = 120 * scale, 40 + 10 * scale, 1500 * scale
    entities = [(i + 1, f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", rng.choice(d["places"]),
                 rng.randint(*d["years"])) for i in range(n_entity)]
    combos = [f"{last} {word}" for last in LAST_NAMES for word in d["item_words"]]
    rng.shuffle(combos)  # unique names, so "the product named X" is one row
    item_names = [combos[i % len(combos)] + (f" {i // len(combos) + 1}" if i >= len(combos) else "")
                  for i in range(n_item)]
    lo, hi = d["num_range"]
    items = [(i + 1, item_names[i], rng.choice(d["cats"]),
              round(rng.uniform(lo, hi), 2) if d["num"] in ("price", "cost") else rng.randint(lo, hi))
             for i in range(n_item)]
    facts = []
    for i in range(n_fact):
        y, m, day = rng.randint(*_FACT_YEARS), rng.randint(1, 12), rng.randint(1, 28)
        facts.append((i + 1, rng.randint(1, n_entity), rng.randint(1, n_item), rng.randint(1, 20), f"{y:04d}-{m:02d}-{day:02d}"))
    values = {"places": sorted({e[2] for e in entities}), "cats": sorted({it[2] for it in items}),
              "items": [it[1] for it in items], "years": sorted({e[3] for e in entities}),
              "most_per_cat": max(sum(it[2] == c for it in items) for c in d["cats"])}
    if forms:
        from tasks.synthetic_forms import stored

        entities = [(a, b, stored(forms["place"], c), y) for a, b, c, y in entities]
        items = [(a, b, stored(forms["cat"], c), n) for a, b, c, n in items]
    num_type = "REAL" if d["num"] in ("price", "cost") else "INTEGER"
    if path.exists():
        path.unlink()
    conn = sqlite3.connect(path)
    conn.executescript(f"""
        CREATE TABLE {d['entity']} ({d['e_id']} INTEGER PRIMARY KEY, name TEXT NOT NULL,
            {d['place']} TEXT, {d['year']} INTEGER);
        CREATE TABLE {d['item']} ({d['i_id']} INTEGER PRIMARY KEY, name TEXT NOT NULL,
            {d['cat']} TEXT, {d['num']} {num_type});
        CREATE TABLE {d['fact']} ({d['f_id']} INTEGER PRIMARY KEY,
            {d['e_id']} INTEGER REFERENCES {d['entity']}({d['e_id']}),
            {d['i_id']} INTEGER REFERENCES {d['item']}({d['i_id']}),
            {d['qty']} INTEGER, {d['date']} TEXT);
        CREATE INDEX idx_{d['fact']}_{d['e_id']} ON {d['fact']}({d['e_id']});
    """)
    conn.executemany(f"INSERT INTO {d['entity']} VALUES (?, ?, ?, ?)", entities)
    conn.executemany(f"INSERT INTO {d['item']} VALUES (?, ?, ?, ?)", items)
    conn.executemany(f"INSERT INTO {d['fact']} VALUES (?, ?, ?, ?, ?)", facts)
    conn.commit()
    conn.close()
    return values


def _write_descriptions(db_dir: Path, d: dict, forms: dict | None = None) -> None:
    """BIRD's database_description/<table>.csv, with BIRD's BOM (with `forms`, the category column's value
    list is left out: it would show the stored form)."""
    desc_dir = db_dir / "database_description"
    desc_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        d["entity"]: [(d["e_id"], f"{d['entity_one']} id", "unique id of the " + d["entity_one"], "integer", ""),
                      ("name", f"{d['entity_one']} name", f"full name of the {d['entity_one']}", "text", ""),
                      (d["place"], d["place_word"], f"the {d['place_word']} of the {d['entity_one']}", "text", ""),
                      (d["year"], d["year"].replace("_", " "), f"the year the {d['entity_one']} {d['year_phrase']}", "integer", "")],
        d["item"]: [(d["i_id"], f"{d['item_one']} id", "unique id of the " + d["item_one"], "integer", ""),
                    ("name", f"{d['item_one']} name", f"name of the {d['item_one']}", "text", ""),
                    (d["cat"], d["cat_word"], f"the {d['cat_word']} of the {d['item_one']}", "text",
                     "" if forms else "one of: " + ", ".join(d["cats"])),
                    (d["num"], d["num_word"], f"the {d['num_word']} of the {d['item_one']}", "real" if d["num"] in ("price", "cost") else "integer", "")],
        d["fact"]: [(d["f_id"], f"{d['fact_one']} id", "unique id of the " + d["fact_one"], "integer", ""),
                    (d["e_id"], f"{d['entity_one']} id", f"the {d['entity_one']} of the {d['fact_one']}", "integer", ""),
                    (d["i_id"], f"{d['item_one']} id", f"the {d['item_one']} of the {d['fact_one']}", "integer", ""),
                    (d["qty"], d["qty_word"], f"the {d['qty_word']}", "integer", ""),
                    (d["date"], d["date"].replace("_", " "), f"the date of the {d['fact_one']}", "date", "YYYY-MM-DD")],
    }
    for table, rows in tables.items():
        with open(desc_dir / f"{table}.csv", "w", encoding="utf-8-sig", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["original_column_name", "column_name", "column_description", "data_format", "value_description"])
            w.writerows(rows)


def _question(template, d: dict, values: dict, rng: random.Random, forms: dict | None = None) -> dict:
    difficulty, q, sql, evidence = template
    if forms:
        from tasks.synthetic_forms import forms_template

        sql, evidence = forms_template(sql, evidence)
    slots = dict(d)
    slots.update(v_place=rng.choice(values["places"]), v_cat=rng.choice(values["cats"]),
                 v_item=rng.choice(values["items"]), v_year=rng.choice(values["years"][:-1] or values["years"]),
                 v_n=rng.choice([n for n in (5, 6, 7, 8) if n < values["most_per_cat"]] or [1]), v_k=rng.choice([3, 5]), v_fyear=rng.randint(*_FACT_YEARS))
    if forms:
        from tasks.synthetic_forms import stored_slots

        slots.update(stored_slots(slots, forms))
    return {"db_id": "", "question": q.format(**slots), "evidence": evidence.format(**slots),
            "SQL": sql.format(**slots), "difficulty": difficulty}


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_dataset(out_dir, num_databases: int = 4, num_questions: int = 400, seed: int = 0,
                  dev_fraction: float = 0.2, scale: int = 1, templates: tuple[int, ...] | None = None,
                  held_out_databases: int = 0, value_forms: str = "", domains: int = len(DOMAINS),
                  value_pool: int = 0) -> Path:
    """Writes train.json, dev.json and both splits' databases under out_dir; returns out_dir.

    `templates`: the TEMPLATES indices questions are drawn from (None: all). With
    `held_out_databases` = 0 the dev split is a random share of questions on the same databases as
    train; with h > 0 it is asked on h further databases of its own (new instances of the train
    domains: the same schema words, other rows, other db_ids), and every question text is assigned to
    one split by a seeded coin per domain, so no dev question is ever asked in train. `value_forms`
    ("suffix" or "case"; "" off): each database stores its place and category values in a form of its own
    (tasks/synthetic_forms.py). `domains`: databases cycle through the first `domains` of DOMAINS.
    `value_pool` = n > 0: each database (training and held out) has n places and 8 categories of its own,
    made-up names no other database and no DOMAINS word has (tasks/synthetic_pool.py)."""
    if not 1 <= domains <= len(DOMAINS):
        raise ValueError(f"write_dataset: domains must be in 1..{len(DOMAINS)}, got {domains}")
    if num_databases < 1 or num_questions < 2 or not 0 < dev_fraction < 1 or scale < 1 or held_out_databases < 0:
        raise ValueError(f"write_dataset: need num_databases>=1, num_questions>=2, 0<dev_fraction<1, scale>=1, "
                         f"held_out_databases>=0 (got {num_databases}, {num_questions}, {dev_fraction}, {scale}, "
                         f"{held_out_databases})")
    if value_pool and value_forms:
        raise ValueError("write_dataset: value_pool and value_forms cannot be combined (the forms are balanced "
                         "over the domains' own word lists)")
    if value_pool < 0:
        raise ValueError(f"write_dataset: value_pool must be >= 0, got {value_pool}")
    pool = tuple(range(len(TEMPLATES))) if templates is None else tuple(templates)
    if not pool or not all(0 <= t < len(TEMPLATES) for t in pool):
        raise ValueError(f"write_dataset: templates must be indices into TEMPLATES (0..{len(TEMPLATES) - 1}), "
                         f"got {pool}")
    out = Path(out_dir)
    build = out / "_build"
    build.mkdir(parents=True, exist_ok=True)

    # Held-out database j: domain j % m (m: the training domains), an instance after every training one
    # (with <= 4 training databases: retail_2, school_2, ...).
    m, rounds = min(num_databases, domains), -(-num_databases // domains)
    held_index = [domains * (rounds + j // m) + j % m for j in range(held_out_databases)]
    forms = {}
    if value_forms:
        from tasks.synthetic_forms import conventions

        def named(i: int) -> tuple[str, str]:
            db_id, d = _domain_for(i, domains)
            return db_id, d["domain"]

        forms = conventions(value_forms, seed, [named(i) for i in range(num_databases)], [named(i) for i in held_index])

    names = []
    if value_pool:
        from tasks.synthetic_pool import pools

        reserved = set(FIRST_NAMES) | set(LAST_NAMES) | {w for dom in DOMAINS for k in ("places", "cats", "item_words")
                                               for w in dom[k]}
        names = pools(seed, num_databases + held_out_databases, value_pool, reserved)
    build_order = list(range(num_databases)) + held_index

    def database(domain_index: int) -> tuple:
        db_id, d = _domain_for(domain_index, domains)
        if names:
            d = dict(d, **names[build_order.index(domain_index)])
        path = build / f"{db_id}.sqlite"
        return db_id, d, path, _build_database(path, d, random.Random(f"{seed}:{domain_index}"), scale, forms.get(db_id))

    dbs = [database(i) for i in range(num_databases)]
    held = [database(i) for i in held_index]
    rng = random.Random(f"{seed}:questions")

    def draw(on: list, k: int) -> dict:
        db_id, d, _, values = on[k % len(on)]
        q = _question(TEMPLATES[pool[rng.randrange(len(pool))]], d, values, rng, forms.get(db_id))
        q["db_id"] = db_id
        return q

    n_dev = max(1, round(num_questions * dev_fraction))
    if not held:
        questions = [draw(dbs, k) for k in range(num_questions)]
        rng.shuffle(questions)
        splits = {"dev": (questions[:n_dev], dbs), "train": (questions[n_dev:], dbs)}
    else:
        # Each question text (per domain) is dev's or train's by a seeded coin, so no dev question is
        # ever a train question, whatever the number of questions.
        def is_dev(q: dict, d: dict) -> bool:
            return random.Random(f"{seed}:split:{d['domain']}:{q['question']}:{q['evidence']}").random() < dev_fraction

        def draw_where(on: list, n: int, dev_side: bool) -> list[dict]:
            """n questions of that side of the coin; dev's are distinct per database (a slot-free
            question would otherwise pass the coin every time it is drawn and crowd out the rest)."""
            got: list[dict] = []
            taken: set = set()
            for k in range(200 * n):
                if len(got) == n:
                    break
                q = draw(on, k)
                key = (q["db_id"], q["question"], q["evidence"])
                if is_dev(q, on[k % len(on)][1]) == dev_side and not (dev_side and key in taken):
                    taken.add(key)
                    got.append(q)
            return got

        train, dev = draw_where(dbs, num_questions - n_dev, False), draw_where(held, n_dev, True)
        splits = {"dev": (dev, held), "train": (train, dbs)}
    for split, (qs, split_dbs) in splits.items():
        rows = [{"question_id": i, "db_id": q["db_id"], "question": q["question"], "evidence": q["evidence"],
                 "SQL": q["SQL"], "difficulty": q["difficulty"]} for i, q in enumerate(qs)]
        (out / f"{split}.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        for db_id, d, path, _ in split_dbs:
            db_dir = out / f"{split}_databases" / db_id
            db_dir.mkdir(parents=True, exist_ok=True)
            _link_or_copy(path, db_dir / f"{db_id}.sqlite")
            _write_descriptions(db_dir, d, forms.get(db_id))
    shutil.rmtree(build, ignore_errors=True)
    return out


def texts_for_tokenizer(out_dir, splits: tuple[str, ...] = ("train",)) -> Iterator[str]:
    """Questions, evidence, gold SQL and schema text of a written dataset's `splits` (tokenizer
    training; the train split alone by default, so nothing of the held-out questions shapes it)."""
    from policies.prompt import schema_compact, schema_ddl
    from tasks.bird import load_split, read_schema

    out = Path(out_dir)
    seen_dbs: set[str] = set()
    for split in splits:
        if not (out / f"{split}.json").exists():
            continue
        for q in load_split(out, split):
            yield q.question
            if q.evidence:
                yield q.evidence
            yield q.sql
            if q.db_path not in seen_dbs:
                seen_dbs.add(q.db_path)
                schema = read_schema(q.db_path)
                yield schema_ddl(schema, 3)
                yield schema_compact(schema)
