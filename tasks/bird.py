"""The BIRD dataset as BIRD ships it: questions, databases, schemas, and rendered prompts.

Layout read (nothing is downloaded):
    <bird_dir>/<split>.json                                   [{question_id?, db_id, question,
                                                                evidence?, SQL, difficulty?}, ...]
    <bird_dir>/<split>_databases/<db_id>/<db_id>.sqlite
    <bird_dir>/<split>_databases/<db_id>/database_description/<table>.csv   (optional per table)

Invariants:
- A missing or malformed required file is one BirdDataError line naming the path (and the
  entry or column at fault); description CSVs are optional, but a malformed one is an error.
- Every Question's db_path exists when load_split returns.
- Schemas are read once per database file per process (cached), through a read-only connection.
- Prompts over the token budget are dropped at build time and counted, never truncated.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import sqlite3
import urllib.parse
from pathlib import Path

import msgspec

from policies.prompt import render_prompt, schema_compact, schema_ddl, tokenize_prompt
from queues.messages import pack_ids


class BirdDataError(ValueError):
    """A one-line, user-facing problem with a BIRD directory."""


class Question(msgspec.Struct, kw_only=True, frozen=True):
    question_id: str
    db_id: str
    question: str
    evidence: str
    sql: str
    difficulty: str
    db_path: str


class Column(msgspec.Struct, kw_only=True):
    name: str
    type: str = ""
    pk: bool = False
    description: str = ""
    value_description: str = ""
    samples: list = []


class ForeignKey(msgspec.Struct, kw_only=True):
    column: str
    ref_table: str
    ref_column: str


class Table(msgspec.Struct, kw_only=True):
    name: str
    columns: list[Column]
    foreign_keys: list[ForeignKey] = []


class Schema(msgspec.Struct, kw_only=True):
    db_id: str
    tables: list[Table]


class PromptItem(msgspec.Struct, kw_only=True):
    prompt_id: str
    db_id: str
    db_path: str
    gold_sql: str
    difficulty: str
    prompt_tokens: bytes  # packed int32 (queues.messages.pack_ids)
    prompt_text: str


def database_path(bird_dir, split: str, db_id: str) -> Path:
    return Path(bird_dir) / f"{split}_databases" / db_id / f"{db_id}.sqlite"


def load_split(bird_dir, split: str) -> list[Question]:
    """The questions of one split, each with the absolute path of its database."""
    root = Path(bird_dir)
    if not root.is_dir():
        raise BirdDataError(f"BIRD directory not found: {root}")
    path = root / f"{split}.json"
    if not path.is_file():
        raise BirdDataError(f"BIRD split file not found: {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BirdDataError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, list):
        raise BirdDataError(f"{path}: expected a JSON list of questions, got {type(raw).__name__}")
    questions = []
    db_paths: dict[str, Path] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise BirdDataError(f"{path}: entry {i} is not an object")
        for key in ("db_id", "question", "SQL"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise BirdDataError(f"{path}: entry {i} has no {key!r} string")
        db_id = entry["db_id"]
        if db_id not in db_paths:
            db = database_path(root, split, db_id)
            if not db.is_file():
                raise BirdDataError(f"database file not found: {db} (entry {i}, db_id {db_id!r})")
            db_paths[db_id] = db.resolve()
        questions.append(Question(
            question_id=str(entry.get("question_id", i)), db_id=db_id, question=entry["question"].strip(),
            evidence=str(entry.get("evidence") or "").strip(), sql=entry["SQL"].strip(),
            difficulty=str(entry.get("difficulty") or ""), db_path=str(db_paths[db_id])))
    return questions


def _read_csv_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")  # a few BIRD description files are not UTF-8


def read_descriptions(db_dir: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """{table (lowercase): {column (lowercase): (description, value description)}}."""
    desc_dir = db_dir / "database_description"
    out: dict[str, dict[str, tuple[str, str]]] = {}
    if not desc_dir.is_dir():
        return out
    for csv_path in sorted(desc_dir.glob("*.csv")):
        try:
            reader = csv.DictReader(io.StringIO(_read_csv_text(csv_path)))
            fields = [f.strip().lower() for f in (reader.fieldnames or [])]
            if "original_column_name" not in fields:
                raise BirdDataError(f"{csv_path}: malformed description file (no 'original_column_name' column)")
            cols: dict[str, tuple[str, str]] = {}
            for row in reader:
                row = {(k or "").strip().lower(): (v or "").strip() for k, v in row.items() if isinstance(v, str) or v is None}
                name = row.get("original_column_name", "")
                if not name:
                    continue
                desc = row.get("column_description") or row.get("column_name") or ""
                cols[name.lower()] = (" ".join(desc.split()), " ".join(row.get("value_description", "").split()))
        except csv.Error as e:
            raise BirdDataError(f"{csv_path}: malformed description file ({e})") from None
        out[csv_path.stem.strip().lower()] = cols
    return out


@functools.lru_cache(maxsize=256)
def _read_schema_cached(db_path: str, mtime_ns: int, sample_values: int) -> Schema:
    path = Path(db_path)
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as e:
        raise BirdDataError(f"{path}: cannot open database ({e})") from None
    conn.text_factory = lambda b: b.decode("utf-8", "replace")
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
        descriptions = read_descriptions(path.parent)
        tables = []
        for name in names:
            q = name.replace('"', '""')
            info = conn.execute(f'PRAGMA table_info("{q}")').fetchall()
            fks = [ForeignKey(column=r[3], ref_table=r[2], ref_column=r[4] or "")
                   for r in conn.execute(f'PRAGMA foreign_key_list("{q}")').fetchall()]
            table_desc = descriptions.get(name.lower(), {})
            cols = []
            for _, col, ctype, _, _, pk in info:
                samples = []
                if sample_values > 0:
                    c = col.replace('"', '""')
                    samples = [r[0] for r in conn.execute(
                        f'SELECT DISTINCT "{c}" FROM "{q}" WHERE "{c}" IS NOT NULL LIMIT {int(sample_values)}')]
                    samples = [s for s in samples if not isinstance(s, bytes)]
                desc, value_desc = table_desc.get(col.lower(), ("", ""))
                cols.append(Column(name=col, type=ctype or "", pk=bool(pk), description=desc,
                                   value_description=value_desc, samples=samples))
            tables.append(Table(name=name, columns=cols, foreign_keys=fks))
    except sqlite3.DatabaseError as e:
        raise BirdDataError(f"{path}: not a readable SQLite database ({e})") from None
    finally:
        conn.close()
    return Schema(db_id=path.stem, tables=tables)


def read_schema(db_path, sample_values: int = 3) -> Schema:
    """Tables, columns, types, keys, sample values and descriptions of one database (cached)."""
    path = Path(db_path)
    if not path.is_file():
        raise BirdDataError(f"database file not found: {path}")
    return _read_schema_cached(str(path.resolve()), path.stat().st_mtime_ns, sample_values)


def schema_text(schema: Schema, style: str, sample_values: int) -> str:
    return schema_compact(schema) if style == "compact" else schema_ddl(schema, sample_values)


def build_prompts(questions: list[Question], tokenizer, max_prompt_tokens: int, style: str = "omnisql",
                  sample_values: int = 3, use_chat_template: bool | None = None,
                  max_turns: int = 1) -> tuple[list[PromptItem], int]:
    """Renders and tokenizes every question; returns the prompts within budget and how many were
    dropped for being over it. The compact style skips the chat template by default."""
    if use_chat_template is None:
        use_chat_template = style != "compact"
    texts: dict[str, str] = {}
    items, dropped = [], 0
    for q in questions:
        if q.db_path not in texts:
            texts[q.db_path] = schema_text(read_schema(q.db_path, sample_values), style, sample_values)
        text = render_prompt(q.question, q.evidence, texts[q.db_path], style, max_turns)
        ids = tokenize_prompt(text, tokenizer, max_prompt_tokens, use_chat_template)
        if ids is None:
            dropped += 1
            continue
        items.append(PromptItem(prompt_id=q.question_id, db_id=q.db_id, db_path=q.db_path, gold_sql=q.sql,
                                difficulty=q.difficulty, prompt_tokens=pack_ids(ids), prompt_text=text))
    return items, dropped

