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
    assert recipes.RECIPES["tiny"]().data.synthetic_templates == list(TINY_TEMPLATES)
