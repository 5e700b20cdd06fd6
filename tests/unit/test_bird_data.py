"""BIRD loader, schema reader, prompts, and the synthetic dataset that shares their code path."""
import hashlib
import json
import shutil

import numpy as np
import pytest

from policies.prompt import render_prompt, schema_compact, schema_ddl, tokenize_prompt
from tasks.bird import BirdDataError, build_prompts, load_split, read_schema
from tasks.sandbox import execute_readonly
from tasks.synthetic import texts_for_tokenizer, write_dataset


@pytest.fixture(scope="module")
def bird(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("bird") / "syn", num_databases=4, num_questions=120, seed=3)


@pytest.fixture(scope="module")
def tokenizer(bird, tmp_path_factory):
    from tasks.tiny_model import build_tokenizer

    return build_tokenizer(texts_for_tokenizer(bird), 512, str(tmp_path_factory.mktemp("tok")))


def test_synthetic_is_deterministic_and_every_gold_runs(bird, tmp_path):
    again = write_dataset(tmp_path / "again", num_databases=4, num_questions=120, seed=3)
    for split in ("train", "dev"):
        assert hashlib.sha256((bird / f"{split}.json").read_bytes()).digest() == \
            hashlib.sha256((again / f"{split}.json").read_bytes()).digest()
    other = write_dataset(tmp_path / "other", num_databases=4, num_questions=120, seed=4)
    assert (other / "train.json").read_bytes() != (bird / "train.json").read_bytes()
    qs = load_split(bird, "train") + load_split(bird, "dev")
    assert len(qs) == 120 and len({q.db_id for q in qs}) == 4
    assert {q.difficulty for q in qs} == {"simple", "moderate", "challenging"}
    for q in qs:
        r = execute_readonly(q.db_path, q.sql, 5, 10_000)
        assert r.status == "ok" and r.rows, (q.sql, r.error)


def test_read_schema_keys_samples_and_descriptions(bird):
    q = next(q for q in load_split(bird, "dev") if q.db_id == "retail")
    schema = read_schema(q.db_path, sample_values=2)
    tables = {t.name: t for t in schema.tables}
    assert set(tables) == {"customers", "products", "orders"}
    orders = tables["orders"]
    assert {(fk.column, fk.ref_table, fk.ref_column) for fk in orders.foreign_keys} == \
        {("customer_id", "customers", "customer_id"), ("product_id", "products", "product_id")}
    assert [c.name for c in orders.columns if c.pk] == ["order_id"]
    city = next(c for c in tables["customers"].columns if c.name == "city")
    assert city.description == "the city of the customer" and len(city.samples) == 2
    ddl = schema_ddl(schema, 2)
    assert "CREATE TABLE orders (" in ddl and "FOREIGN KEY (customer_id) REFERENCES customers (customer_id)" in ddl
    assert "-- the city of the customer; example: [" in ddl
    assert schema_compact(schema).splitlines()[0] == "customers(customer_id, name, city, signup_year)"
    assert read_schema(q.db_path, sample_values=2) is schema  # cached per database


def test_prompts_render_both_styles_and_drop_over_budget(bird, tokenizer):
    qs = load_split(bird, "dev")
    items, dropped = build_prompts(qs, tokenizer, max_prompt_tokens=100_000, style="omnisql")
    assert dropped == 0 and len(items) == len(qs)
    first = items[0]
    assert qs[0].question in first.prompt_text and "SQLite" in first.prompt_text and "```sql" in first.prompt_text
    ids = np.frombuffer(first.prompt_tokens, dtype="<i4")
    assert tokenizer.decode(ids.tolist()).startswith("user: Task Overview")  # through the chat template
    compact, _ = build_prompts(qs, tokenizer, 100_000, style="compact")
    assert compact[0].prompt_text.endswith("SQL:") and "CREATE TABLE" not in compact[0].prompt_text
    lengths = sorted(len(it.prompt_tokens) // 4 for it in compact)
    budget = lengths[len(lengths) // 2]
    kept, dropped = build_prompts(qs, tokenizer, budget, style="compact")
    assert dropped == sum(1 for n in lengths if n > budget) > 0 and len(kept) + dropped == len(qs)


def test_tokenize_prompt_without_chat_template(tokenizer):
    plain = tokenize_prompt("SELECT 1", tokenizer, 100, use_chat_template=False)
    assert tokenizer.decode(plain) == "SELECT 1"
    assert tokenize_prompt("SELECT 1 " * 50, tokenizer, 10) is None
    with pytest.raises(ValueError, match="unknown prompt style 'fancy'"):
        render_prompt("q", "e", "s", "fancy")


def _copy(bird, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bird, dst)
    return dst


@pytest.mark.parametrize("breakage, message", [
    (lambda d: shutil.rmtree(d), "BIRD directory not found"),
    (lambda d: (d / "dev.json").unlink(), "BIRD split file not found: {d}/dev.json"),
    (lambda d: (d / "dev.json").write_text("[{oops"), "{d}/dev.json: not valid JSON"),
    (lambda d: (d / "dev.json").write_text('{"a": 1}'), "expected a JSON list"),
    (lambda d: (d / "dev.json").write_text('[{"db_id": "retail", "question": "q"}]'), "entry 0 has no 'SQL' string"),
    (lambda d: (d / "dev.json").write_text('[{"db_id": "nowhere", "question": "q", "SQL": "SELECT 1"}]'),
     "database file not found: {d}/dev_databases/nowhere/nowhere.sqlite"),
])
def test_loader_errors_are_one_line_and_name_the_path(bird, tmp_path, breakage, message):
    d = _copy(bird, tmp_path)
    breakage(d)
    with pytest.raises(BirdDataError) as err:
        load_split(d, "dev")
    text = str(err.value)
    assert message.format(d=d) in text and "\n" not in text


def test_description_csv_encodings_and_malformed(bird, tmp_path):
    d = _copy(bird, tmp_path)
    db_dir = d / "dev_databases" / "retail"
    csv_path = db_dir / "database_description" / "customers.csv"
    csv_path.write_bytes("original_column_name,column_name,column_description\ncity,city,caf\xe9 town\n".encode("latin-1"))
    city = next(c for t in read_schema(db_dir / "retail.sqlite").tables for c in t.columns if c.name == "city")
    assert city.description == "café town"
    csv_path.write_text("\ufeffwhat,ever\n1,2\n", encoding="utf-8")
    with pytest.raises(BirdDataError, match="customers.csv: malformed description file"):
        read_schema(db_dir / "retail.sqlite", sample_values=1)
    (db_dir / "retail.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(BirdDataError, match="retail.sqlite: not a readable SQLite database"):
        read_schema(db_dir / "retail.sqlite", sample_values=0)


def test_bird_train_layout_without_ids_or_difficulty(bird, tmp_path):
    d = _copy(bird, tmp_path)
    rows = json.loads((d / "train.json").read_text())[:3]
    for r in rows:
        del r["question_id"], r["difficulty"]
    (d / "train.json").write_text(json.dumps(rows))
    qs = load_split(d, "train")
    assert [q.question_id for q in qs] == ["0", "1", "2"] and all(q.difficulty == "" for q in qs)
