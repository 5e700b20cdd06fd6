"""launch.serve's request plumbing: options, the one-line request error, checked fields, bounded bodies,
who gets in.

Invariants: a bad request is a RequestError(status, one-line reason), answered as {"error": reason};
a body over MAX_BODY_BYTES is refused before it is read whole; databases are named only by db_id.
An address other than loopback is served only with an API key (`host_refusal`); with a key, a request
passes only with `Authorization: Bearer <key>` (or HTTP Basic with the key as password, so a browser
can open the page). The replicas hold the key's SHA-256 only, never the key, and compare in constant
time.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

MAX_BODY_BYTES = 64 * 1024


@dataclass
class ServeOptions:
    model: str
    bird_dir: str
    split: str = "dev"
    engine: str = ""  # "" -> vllm with a GPU, transformers otherwise
    device: str = "auto"
    max_batch_size: int = 8  # requests per @serve.batch call (1: no batching)
    batch_wait_s: float = 0.02
    max_tokens: int = 0  # 0: the export's
    max_question_chars: int = 2000
    max_evidence_chars: int = 4000
    request_timeout_s: float = 120.0
    sql_timeout_s: float = 10.0
    sql_workers: int = 2
    sql_max_workers: int = 8  # the pool grows to this while every worker is busy (runaway queries)
    sql_max_rows: int = 10_000  # more is the verdict too_many_rows
    return_rows: int = 200  # rows sent back (row_count says how many there were)
    engine_kwargs: dict = field(default_factory=dict)
    api_key_sha256: str = ""  # "" -> no key: every route is open (loopback only, see host_refusal)
    health_poll_s: float = 1.0  # /healthz asks Ray Serve's controller this often (launch/serve_health.py)
    health_max_age_s: float = 15.0  # an older answer is a 503
    replica_nice: int = 10  # model replicas this many nice levels below the proxy and /healthz (serve_life)


class RequestError(Exception):
    """A request the service answers with `status` and {"error": reason} (one line)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def find_databases(bird_dir: str | Path, split: str) -> dict[str, str]:
    """{db_id: sqlite path} of <bird_dir>/<split>_databases/<db_id>/<db_id>.sqlite (ValueError, one line)."""
    from tasks.bird import database_path

    root = Path(bird_dir) / f"{split}_databases"
    if not root.is_dir():
        raise ValueError(f"databases directory not found: {root} (--bird-dir / --split)")
    dbs = {p.name: str(database_path(bird_dir, split, p.name).resolve()) for p in sorted(root.iterdir())
           if database_path(bird_dir, split, p.name).is_file()}
    if not dbs:
        raise ValueError(f"no <db_id>/<db_id>.sqlite under {root}")
    return dbs


def field_of(body: Any, name: str, kind: type, required: bool = True, max_chars: int = 0) -> Any:
    """One checked field of a request body (RequestError 422 naming it)."""
    if name not in body or body[name] is None:
        if required:
            raise RequestError(422, f"missing field {name!r}")
        return None
    value = body[name]
    if kind is bool and not isinstance(value, bool) or kind is str and not isinstance(value, str):
        raise RequestError(422, f"field {name!r} must be a {'boolean' if kind is bool else 'string'}, got {type(value).__name__}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RequestError(422, f"field {name!r} must be an integer, got {type(value).__name__}")
    if kind is str:
        value = value.strip()
        if required and not value:
            raise RequestError(422, f"field {name!r} is empty")
        if max_chars and len(value) > max_chars:
            raise RequestError(422, f"field {name!r} is {len(value)} characters, the limit is {max_chars}")
    return value


MAX_TURNS = 8  # a request's max_turns at most


def request_turns(body: Any, trained: int) -> int:
    """A request's max_turns: its own (1..MAX_TURNS; RequestError 422 naming the field otherwise), else (absent,
    null or 0) the export's generator.max_turns: a model trained on multi-turn episodes answers from their
    prompt, and from the single-turn one it never saw it may write no SQL at all."""
    asked = field_of(body, "max_turns", int, required=False)
    if not asked:
        return max(1, min(MAX_TURNS, int(trained or 1)))
    if not 1 <= asked <= MAX_TURNS:
        raise RequestError(422, f"field 'max_turns' must be in 1..{MAX_TURNS} (0: as the model trained), got {asked}")
    return asked


async def read_json(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"body is {declared} bytes, the limit is {MAX_BODY_BYTES}")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body is {len(raw)} bytes, the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"body must be a JSON object, got {type(body).__name__}")
    return body


def json_value(v: Any) -> Any:
    """A SQLite value as JSON can carry it (bytes as hex, non-finite floats as text)."""
    if isinstance(v, bytes):
        return "0x" + v.hex()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason.replace("\n", " ")[:500]}, status_code=status)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def host_refusal(host: str, api_key: str | None) -> str:
    """"" when `host` may be served with this key; else the one-line reason (the CLI's exit 2)."""
    if api_key is not None and not api_key.strip():
        return "the API key is empty: set --api-key or ARL_API_KEY to a secret, or unset it"
    if not is_loopback(host) and not api_key:
        return (f"--host {host} is not loopback: anyone who reaches it could use the service; set an API key "
                f"(ARL_API_KEY, or --api-key) so that only requests with 'Authorization: Bearer <key>' get in")
    return ""


def key_digest(api_key: str | None) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


def auth_refusal(digest: str, header: str | None) -> str:
    """"" when a request with this Authorization header may pass a service whose key has `digest`
    ("" digest: no key, everyone passes); else the one-line reason for its 401."""
    if not digest:
        return ""
    if not header:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "basic":  # a browser's login prompt: any user name, the key as password
        try:
            value = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return "malformed Basic credentials"
    elif scheme.lower() != "bearer":
        return f"unsupported authorization scheme {scheme[:20]!r}: send 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(hashlib.sha256(value.strip().encode()).hexdigest(), digest):
        return "wrong API key"
    return ""
