"""Prompt rendering for text-to-SQL: schema text, the prompt, and tokenization under a budget.

Invariants:
- Pure: text in, text (or token ids) out. The schema is any object shaped like
  tasks.bird.Schema (tables -> columns with name/type/pk/description/samples, foreign keys).
- Two styles: "omnisql" (the full instruction prompt for real models: engine, CREATE TABLE
  schema with sample values and descriptions, evidence, question, and the <think> / ```sql
  answer format) and "compact" (a few lines for the tiny CPU model: table(col, ...) lines,
  the question, the evidence, then "SQL:").
- A prompt over its token budget is refused (None), never truncated: a cut schema is a wrong task.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STYLES = ("omnisql", "compact")

_OMNISQL = """Task Overview:
You are a data science expert. You are given a database schema and a question in natural language. Write one SQLite query that answers the question.

Database Engine:
SQLite

Database Schema:
{schema}
The schema lists each table's columns with their types, a few example values and descriptions, and the primary and foreign keys that relate the tables.

Question:
{question_block}

Instructions:
- Return exactly the information the question asks for: no extra columns, nothing missing.
- Use the external knowledge (the evidence) when it is given; it states how question terms map to columns and values.
- Think through the tables, joins and conditions before you write the query.

Output Format:
Reason step by step inside <think> ... </think>, then give the final SQL query in a code block:
```sql
-- your SQL query
```
"""


def _quote_value(v: Any) -> str:
    if isinstance(v, str):
        text = v if len(v) <= 40 else v[:37] + "..."
        return "'" + text.replace("'", "''") + "'"
    return repr(v)


def schema_ddl(schema, sample_values: int = 3) -> str:
    """CREATE TABLE statements with, per column, example values and its description as a comment."""
    parts = []
    for table in schema.tables:
        lines = []
        for col in table.columns:
            comment = []
            if col.description:
                comment.append(col.description)
            if col.value_description:
                comment.append(col.value_description)
            if sample_values > 0 and col.samples:
                comment.append("example: [" + ", ".join(_quote_value(v) for v in col.samples[:sample_values]) + "]")
            line = f"  {_ident(col.name)} {col.type or ''}".rstrip() + ","
            if comment:
                line += " -- " + "; ".join(c.replace("\n", " ") for c in comment)
            lines.append(line)
        pks = [c.name for c in table.columns if c.pk]
        if pks:
            lines.append(f"  PRIMARY KEY ({', '.join(_ident(p) for p in pks)}),")
        for fk in table.foreign_keys:
            lines.append(f"  FOREIGN KEY ({_ident(fk.column)}) REFERENCES {_ident(fk.ref_table)} ({_ident(fk.ref_column)}),")
        # The last element carries no trailing comma (comments follow the comma on column lines).
        if lines:
            last = lines[-1]
            head, sep, tail = last.partition(" -- ")
            lines[-1] = head.rstrip(",") + (sep + tail if sep else "")
        parts.append(f"CREATE TABLE {_ident(table.name)} (\n" + "\n".join(lines) + "\n);")
    return "\n".join(parts)


def schema_compact(schema) -> str:
    """One line per table: name(col, col, ...)."""
    return "\n".join(f"{t.name}({', '.join(c.name for c in t.columns)})" for t in schema.tables)


def _ident(name: str) -> str:
    """Quotes an identifier only when it needs it (BIRD has names with spaces)."""
    if name.replace("_", "").isalnum() and not name[:1].isdigit():
        return name
    return "`" + name.replace("`", "``") + "`"


def render_prompt(question: str, evidence: str, schema_text: str, style: str = "omnisql", max_turns: int = 1) -> str:
    """The prompt; with max_turns > 1 it also says how to run queries first (policies/episode.py), and
    with max_turns = 1 it is the one-shot prompt exactly."""
    from policies.episode import instructions

    if style == "omnisql":
        question_block = f"{evidence}\n{question}" if evidence else question
        return _OMNISQL.format(schema=schema_text, question_block=question_block) + instructions(style, max_turns)
    if style == "compact":
        lines = [schema_text, f"Q: {question}"]
        if evidence:
            lines.append(f"E: {evidence}")
        lines.append(instructions(style, max_turns).strip() + "\nSQL:" if max_turns > 1 else "SQL:")
        return "\n".join(lines)
    raise ValueError(f"unknown prompt style {style!r}; expected one of {', '.join(STYLES)}")


def _ids(encoded) -> list[int]:
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "ids"):  # tokenizers.Encoding
        encoded = encoded.ids
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # batched output of one conversation
        encoded = encoded[0]
    return [int(i) for i in encoded]


def tokenize_prompt(text: str, tokenizer, max_tokens: int, use_chat_template: bool = True) -> list[int] | None:
    """Token ids of the prompt (through the chat template when the tokenizer has one), or None
    when they exceed max_tokens. Accepts a transformers tokenizer or a tokenizers.Tokenizer."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = _ids(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 add_generation_prompt=True))
    else:
        ids = _ids(tokenizer.encode(text))
    return ids if len(ids) <= max_tokens else None
