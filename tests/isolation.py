"""The unit lane's isolation guard (tests/unit/conftest.py installs it around every unit test's setup, call and
teardown, and around the import of every unit test module).

Invariant: while `isolated()` is active, opening a network or unix socket (connect, bind, listen), starting a
process (subprocess, multiprocessing, os.fork/posix_spawn/system), importing Ray or DeepSpeed from our code or a
test (an installed library may import them: accelerate does, on every save_pretrained), or calling ray.init,
deepspeed.initialize or torch.distributed.init_process_group raises
`IsolationError` and is recorded, so a test whose code swallows the error still fails; everything is put back
on exit. Importing the redis client library is allowed (queues/streams.py imports it at top level; it is cheap);
talking to a Redis is not, since that needs a socket (and starting one, a process). asyncio's event loop
(socketpair) and threads are allowed.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import socket
import sys

BLOCKED_IMPORTS = ("ray", "deepspeed")
_SOCKET_METHODS = ("connect", "connect_ex", "bind", "listen")
_OS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve")


class IsolationError(Exception):
    """A unit test reached for a socket, a process, Ray or DeepSpeed."""


def _imported_by_a_library() -> bool:
    """Whether the import statement being run is an installed library's (accelerate's unwrap_model imports
    DeepSpeed whenever it is installed, e.g. inside transformers' save_pretrained), not ours or a test's."""
    frame = sys._getframe(2)
    while frame is not None and ("importlib" in frame.f_code.co_filename and "site-packages" not in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and f"{os.sep}site-packages{os.sep}" in frame.f_code.co_filename


class _BlockedImports(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the blocked packages (so availability checks such as find_spec still say they are installed) and
    fails their import."""

    def __init__(self, deny):
        self.deny = deny

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in BLOCKED_IMPORTS and top not in sys.modules and not _imported_by_a_library():
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        self.deny(f"import {spec.name}")

    def exec_module(self, module):  # never reached: create_module raises
        raise IsolationError(module.__name__)


@contextlib.contextmanager
def isolated(where: str):
    """Deny sockets, processes and the blocked imports for the block; yields the list of what was tried."""
    tried: list[str] = []

    def deny(what: str):
        tried.append(what)
        raise IsolationError(f"{where}: {what} is not allowed in tests/unit (no Ray, Redis, subprocess or sockets;"
                             f" move the test to tests/integration)")

    def blocked(name):
        def call(*args, **kwargs):
            deny(name)
        return call

    import _posixsubprocess
    import subprocess

    saved: list[tuple[object, str, object]] = []

    def patch(owner, name, value):
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    for name in _SOCKET_METHODS:
        patch(socket.socket, name, blocked(f"socket.{name}"))
    patch(subprocess.Popen, "_execute_child", blocked("starting a process (subprocess)"))
    patch(_posixsubprocess, "fork_exec", blocked("starting a process (multiprocessing)"))
    for name in _OS_CALLS:
        patch(os, name, blocked(f"os.{name}"))
    # Already imported (by a library, or by another lane's module in the same session): their entry points.
    if "torch.distributed" in sys.modules:
        patch(sys.modules["torch.distributed"], "init_process_group", blocked("torch.distributed.init_process_group"))
    if "deepspeed" in sys.modules:
        for name in ("initialize", "init_distributed", "init_inference"):
            patch(sys.modules["deepspeed"], name, blocked(f"deepspeed.{name}"))
    if "ray" in sys.modules:
        patch(sys.modules["ray"], "init", blocked("ray.init"))
    finder = _BlockedImports(deny)
    sys.meta_path.insert(0, finder)
    try:
        yield tried
    finally:
        sys.meta_path.remove(finder)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
