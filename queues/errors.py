"""One-line, user-facing error text, in one place (the launcher, the SQL sandbox, the generator).

Invariants: `one_line(e)` is a single line (no newline), at most `limit` characters, names the
exception type, reports the innermost cause of a Ray-wrapped error (RayTaskError.cause), and never
shows a password from a redis:// URL (`redact`). Stdlib only: the sandbox's worker processes import it.
"""
from __future__ import annotations

import re


def redact(url: str) -> str:
    """redis://user:secret@host:6379/0 -> redis://user:***@host:6379/0"""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def one_line(e: BaseException, limit: int = 400) -> str:
    """The innermost cause of `e` (Ray wraps actor exceptions) as `Type: first line`, redacted."""
    seen = 0
    while seen < 8 and getattr(e, "cause", None) is not None and e.cause is not e:  # RayTaskError
        e, seen = e.cause, seen + 1
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    name = type(e).__name__
    if name.startswith("RayTaskError(") or name == "RayTaskError":
        name = name[len("RayTaskError("):-1] if "(" in name else name
    return redact(f"{name}: {text}" if text else name)[:limit]
