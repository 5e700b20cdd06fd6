"""The OpenAI-compatible face of launch.serve: `GET /v1/models` and `POST /v1/chat/completions`.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    r = client.chat.completions.create(model="arl-sql/<db_id>", messages=[{"role": "user", "content": "How many ...?"}])
    r.choices[0].message.content   # the SQL
    r.rows, r.columns, r.verdict   # its execution (extra fields beside OpenAI's)

Invariants:
- The question is the last user message (a string or a list of text parts); the database is the field
  `db_id` (the client's extra_body) or the model name's suffix `arl-sql/<db_id>`; `evidence` and
  `execute` (default true) are optional extra fields. Generation is /v1/sql's: greedy, the training
  prompt; sampling fields (temperature, top_p, n > 1...) are ignored, and `n` above 1 is refused.
- `stream: true` is a 400 with one line; every error body is {"error": "<one line>"}.
- Pure request/response shaping: the service (launch/serve_app.py) generates and executes.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from launch.serve_http import RequestError, field_of

MODEL_ID = "arl-sql"


def models_list(dbs) -> dict:
    """/v1/models: the service's model and one `arl-sql/<db_id>` per database."""
    ids = [MODEL_ID] + [f"{MODEL_ID}/{db}" for db in dbs]
    return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "arctic-rl"} for i in ids]}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise RequestError(422, f"a message's 'content' must be a string or a list of text parts, got {type(content).__name__}")


def parse_chat(body: dict, dbs, max_question_chars: int, max_evidence_chars: int) -> tuple[str, str, str, bool]:
    """(question, db_id, evidence, execute) of a chat completion request (RequestError, one line)."""
    if body.get("stream"):
        raise RequestError(400, "stream is not supported: send stream false (the answer is one SQL query)")
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError(422, f"field 'n' must be 1 (generation is greedy), got {n!r}")
    model = field_of(body, "model", str)
    base, _, suffix = model.partition("/")
    if base != MODEL_ID:
        raise RequestError(404, f"unknown model {model!r}: use {MODEL_ID!r} or '{MODEL_ID}/<db_id>' (GET /v1/models)")
    db_id = field_of(body, "db_id", str, required=False) or suffix
    if not db_id:
        raise RequestError(422, f"name the database: field 'db_id' or model '{MODEL_ID}/<db_id>'")
    if db_id not in dbs:
        raise RequestError(404, f"unknown db_id {db_id!r} (GET /v1/models lists {len(dbs)})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "field 'messages' must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RequestError(422, "field 'messages' has no user message (the question)")
    question = field_of({"question": _text(users[-1].get("content"))}, "question", str, max_chars=max_question_chars)
    evidence = field_of(body, "evidence", str, required=False, max_chars=max_evidence_chars) or ""
    execute = field_of(body, "execute", bool, required=False)
    return question, db_id, evidence, True if execute is None else execute


def chat_response(answer: dict, model: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> dict:
    """An OpenAI chat.completion whose message content is the SQL ("" when the model wrote none),
    with /v1/sql's fields (db_id, sql, verdict, columns, rows, row_count, error, timings...) beside."""
    finish = "length" if answer.get("finish_reason") == "length" else "stop"
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.get("sql") or ""},
                         "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            **{k: v for k, v in answer.items() if k not in ("question",)}}
