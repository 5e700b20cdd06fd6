"""The tiny recipe's task: held-out databases and questions, template subsets, and the slips its warm
start learns from (tasks/synthetic.py). Plain SQLite, no Ray."""
import json
import sqlite3

import pytest

from tasks.synthetic import SLIPS, TEMPLATES, TINY_TEMPLATES, slipped, template_of, write_dataset


@pytest.fixture(scope="module")
def held_out_task(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("tinytask") / "syn", num_databases=3, num_questions=300, seed=5,
                         templates=None, held_out_databases=3)


def _rows(bird, split):
    return json.loads((bird / f"{split}.json").read_text())


def _run(bird, split, q, sql):
    con = sqlite3.connect(bird / f"{split}_databases" / q["db_id"] / f"{q['db_id']}.sqlite")
    try:
        return set(con.execute(sql).fetchall())
    finally:
        con.close()


def test_held_out_split_shares_no_database_and_no_question_with_train(held_out_task):
    train, dev = _rows(held_out_task, "train"), _rows(held_out_task, "dev")
    assert len(train) == 240 and len(dev) == 60
    assert {q["db_id"] for q in train} == {"retail", "school", "library"}
    assert {q["db_id"] for q in dev} == {"retail_2", "school_2", "library_2"}
    assert not {(q["question"], q["evidence"]) for q in dev} & {(q["question"], q["evidence"]) for q in train}
    assert sorted(p.name for p in (held_out_task / "dev_databases").iterdir()) == ["library_2", "retail_2", "school_2"]


def test_every_slip_runs_and_answers_another_question(held_out_task):
    """The slip of every gold query (recovered from its text) is valid SQL with other result rows:
    RL's reward tells them apart (1.0 vs 0.1)."""
    seen = set()
    for split in ("train", "dev"):
        for q in _rows(held_out_task, split):
            i = template_of(q["SQL"])
            assert i is not None, q["SQL"]
            seen.add(i)
            slip = slipped(q["SQL"])
            assert slip != q["SQL"] and _run(held_out_task, split, q, slip) != _run(held_out_task, split, q, q["SQL"]), q
    assert seen == set(range(len(TEMPLATES))) and len(SLIPS) == len(TEMPLATES)
    assert slipped("SELECT 1") is None and template_of("SELECT 1") is None


def test_questions_come_from_the_template_subset_only(tmp_path):
    bird = write_dataset(tmp_path / "syn", 2, 60, seed=1, templates=TINY_TEMPLATES, held_out_databases=2)
    assert {template_of(q["SQL"]) for s in ("train", "dev") for q in _rows(bird, s)} <= set(TINY_TEMPLATES)
    with pytest.raises(ValueError, match="templates"):
        write_dataset(tmp_path / "bad", 2, 60, templates=(99,))


def test_held_out_questions_are_distinct_per_database(held_out_task):
    dev = _rows(held_out_task, "dev")
    assert len({(q["db_id"], q["question"], q["evidence"]) for q in dev}) == len(dev)


def test_recipes_name_the_tiny_templates():
    """config/ imports nothing of ours, so the tiny recipe states the templates itself: they must stay equal."""
    from config import recipes

    assert recipes.TINY_TEMPLATES == TINY_TEMPLATES
    # tiny_forms' templates: exactly tiny's whose gold compares a place or category value
    assert recipes.FORMS_TEMPLATES == tuple(t for t in TINY_TEMPLATES
                                            if "'{v_place}'" in TEMPLATES[t][2] or "'{v_cat}'" in TEMPLATES[t][2])
    assert recipes.RECIPES["tiny"]().data.synthetic_templates == list(TINY_TEMPLATES)


def _digest(bird) -> str:
    """sha256 of both splits' questions, two databases' rows (iterdump: independent of SQLite's file
    layout) and two description files."""
    import hashlib

    h = hashlib.sha256((bird / "train.json").read_bytes() + (bird / "dev.json").read_bytes())
    for split, db, table in (("train", "retail", "products"), ("dev", "school_2", "courses")):
        con = sqlite3.connect(bird / f"{split}_databases" / db / f"{db}.sqlite")
        try:
            h.update("\n".join(con.iterdump()).encode())
        finally:
            con.close()
        h.update((bird / f"{split}_databases" / db / "database_description" / f"{table}.csv").read_bytes())
    return h.hexdigest()


def test_value_forms_off_writes_the_same_bytes_as_before(tmp_path):
    """The option off is nothing: the digest was taken from main before data.synthetic_value_forms existed
    (9ab0ff0), and the default call is the option off with every domain."""
    before = "c417a043ab70df67dd432502413b74b6fffe60b965648574fa940fccf2bc41fe"
    args = dict(num_databases=3, num_questions=120, seed=5, templates=TINY_TEMPLATES, held_out_databases=3)
    assert _digest(write_dataset(tmp_path / "a", **args)) == before
    assert _digest(write_dataset(tmp_path / "b", **args, value_forms="", domains=4)) == before


@pytest.mark.parametrize("kind", ["suffix", "case"])
def test_value_conventions_are_seeded_and_balanced(kind):
    from tasks.synthetic_forms import COLUMNS, KINDS, conventions

    domains = ("retail", "school", "library")
    train = [(f"{dom}_{r}", dom) for r in range(3) for dom in domains]
    held = [(f"h{j}", domains[j % 3]) for j in range(6)]
    got, forms = conventions(kind, 7, train, held), KINDS[kind]
    assert got == conventions(kind, 7, train, held) and got != conventions(kind, 8, train, held)
    for col in COLUMNS:
        for dom in domains:  # three instances of a domain (identical prompts): every form once
            assert sorted(got[db][col] for db, d in train if d == dom) == sorted(forms)
        assert sorted(got[db][col] for db, _ in held) == sorted(forms * 2)  # held out: each form on a third
    for r in range(3):  # each round of instances holds the forms evenly
        assert sorted(got[f"{dom}_{r}"][col] for dom in domains for col in COLUMNS) == sorted(forms * 2)
    with pytest.raises(ValueError, match="kind"):
        conventions("italic", 7, train, held)


@pytest.fixture(scope="module", params=["suffix", "case"])
def forms_task(request, tmp_path_factory):
    bird = write_dataset(tmp_path_factory.mktemp("formstask") / "syn", num_databases=6, num_questions=240, seed=3,
                         templates=TINY_TEMPLATES, held_out_databases=3, value_forms=request.param, domains=3)
    return bird, request.param


def test_value_forms_gold_uses_the_stored_form_and_the_evidence_hides_it(forms_task):
    """Every place / category literal of a gold query is stored in the database exactly so (the gold runs and
    finds rows), is the question's word in one of the kind's forms, is never in the evidence, and the probe of
    the gold (tasks.synthetic_episodes.probe) shows exactly that literal."""
    import re

    from tasks.synthetic_episodes import probe
    from tasks.synthetic_forms import KINDS, stored

    bird, kind = forms_task
    seen, literal_questions = set(), 0
    for split in ("train", "dev"):
        for q in _rows(bird, split):
            literals = re.findall(r"(\w+) = '([^']*)'", q["SQL"])
            if not literals:
                assert probe(q["SQL"]) is None
                continue
            literal_questions += 1
            (column, value), = literals
            assert "'" not in q["evidence"] and (value.lower() not in q["evidence"].lower()
                                                 or f"the {column} column" in q["evidence"])
            assert _run(bird, split, q, q["SQL"])  # the gold runs and returns rows
            assert _run(bird, split, q, probe(q["SQL"])) == {(value,)}  # the literal is stored exactly so
            form = next(f for f in KINDS[kind] for w in re.findall(r"\w+", q["question"]) if stored(f, w) == value)
            seen.add(form)
    assert literal_questions > 100 and seen == set(KINDS[kind])
    assert {q["db_id"] for q in _rows(bird, "dev")} == {"retail_3", "school_3", "library_3"}  # after every training instance
    assert {q["db_id"] for q in _rows(bird, "train")} == {"retail", "school", "library", "retail_2", "school_2", "library_2"}


def test_value_forms_need_prompts_without_sample_values():
    from config import ConfigError, apply_overrides
    from config.recipes import get_recipe

    with pytest.raises(ConfigError, match="data.sample_values"):
        apply_overrides(get_recipe("tiny_forms"), ["data.sample_values=3"])
    with pytest.raises(ConfigError, match="data.synthetic_domains"):
        apply_overrides(get_recipe("tiny_forms"), ["data.synthetic_domains=5"])


def test_held_out_databases_follow_every_training_instance(tmp_path):
    """With more training databases than domains (retail_2 is then a training database), held-out databases
    are later instances still: never a training database rebuilt under the same db_id."""
    bird = write_dataset(tmp_path / "syn", 6, 60, seed=2, templates=TINY_TEMPLATES, held_out_databases=2)
    train_ids, dev_ids = {q["db_id"] for q in _rows(bird, "train")}, {q["db_id"] for q in _rows(bird, "dev")}
    assert {"retail_2", "school_2"} <= train_ids and dev_ids == {"retail_3", "school_3"}


def test_value_pool_gives_every_database_values_of_its_own(tmp_path):
    """data.synthetic_value_pool: no place or category value is shared by two databases or is a DOMAINS
    word, so no held-out value ever appears in a training question; every gold query still runs and
    returns rows on its own database, and the category list the schema shows is the database's own."""
    from tasks.synthetic import DOMAINS

    bird = write_dataset(tmp_path / "syn", 4, 400, seed=3, templates=(0, 1, 4, 5, 9), held_out_databases=2,
                         value_pool=12)
    train, dev = _rows(bird, "train"), _rows(bird, "dev")
    values: dict[str, set] = {}
    for split, rows in (("train", train), ("dev", dev)):
        for q in rows:
            db = bird / f"{split}_databases" / q["db_id"] / f"{q['db_id']}.sqlite"
            con = sqlite3.connect(db)
            try:
                d = next(d for d in DOMAINS if d["entity"] in {r[0] for r in con.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'")})
                places = {r[0] for r in con.execute(f"SELECT DISTINCT {d['place']} FROM {d['entity']}")}
                cats = {r[0] for r in con.execute(f"SELECT DISTINCT {d['cat']} FROM {d['item']}")}
            finally:
                con.close()
            values.setdefault(q["db_id"], places | cats)
            assert len(places) <= 12 and len(cats) <= 8
            assert not (places | cats) & (set(d["places"]) | set(d["cats"]))
            assert _run(bird, split, q, q["SQL"]), q
    ids = sorted(values)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            assert not values[a] & values[b], (a, b)
    train_text = " ".join(q["question"] for q in train)
    dev_values = set().union(*(values[db] for db in {q["db_id"] for q in dev}))
    assert dev_values and not any(v in train_text for v in dev_values)
    desc = (bird / "dev_databases" / dev[0]["db_id"] / "database_description").glob("*.csv")
    shown = " ".join(p.read_text(encoding="utf-8-sig") for p in desc)
    assert any(v in shown for v in values[dev[0]["db_id"]])


def test_value_pool_is_seeded_and_refuses_value_forms(tmp_path):
    from config import ConfigError, apply_overrides
    from config.recipes import get_recipe
    from tasks.synthetic_pool import pools

    assert pools(4, 3, 5) == pools(4, 3, 5) != pools(5, 3, 5)
    args = dict(num_databases=2, num_questions=60, seed=1, templates=TINY_TEMPLATES, held_out_databases=2, value_pool=6)
    assert _digest(write_dataset(tmp_path / "a", **args)) == _digest(write_dataset(tmp_path / "b", **args))
    with pytest.raises(ValueError, match="value_pool and value_forms"):
        write_dataset(tmp_path / "c", **args, value_forms="suffix")
    with pytest.raises(ConfigError, match="data.synthetic_value_pool"):
        apply_overrides(get_recipe("tiny_forms"), ["data.synthetic_value_pool=16"])
    with pytest.raises(ConfigError, match="data.synthetic_value_pool"):
        apply_overrides(get_recipe("tiny"), ["data.synthetic_value_pool=1"])
