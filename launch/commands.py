"""The commands the project prints for a user to paste: the interpreter that is running now.

Invariants: every printed command starts with this process's Python (its path relative to the current
directory when it lies below it, so a venv's `.venv/bin/python` works without activating it), every
argument is shell-quoted, and each one parses with its module's own argument parser
(tests/integration/test_commands.py runs them).
"""
from __future__ import annotations

import os
import shlex
import sys


def python() -> str:
    """This interpreter as a user types it: ./.venv/bin/python below the current directory, else absolute."""
    exe = os.path.abspath(sys.executable)  # a venv's bin/python, not resolved to the base interpreter
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def command(module: str, *args) -> str:
    """`<python> -m <module> <args...>`, shell-quoted."""
    return " ".join(shlex.quote(str(a)) for a in (python(), "-m", module, *args))
