"""launch.serve's life cycle: a port checked before anything starts, SIGTERM as Ctrl-C, and a stop
that leaves no Ray process, agent, socket or temp dir behind.

Invariants:
- `check_port` binds the proxy's address once, before Ray starts: a taken port or an address this
  host does not have is one ValueError line (the CLI's exit 2), not Ray Serve's tracebacks.
- After `interrupt_on_sigterm`, SIGTERM raises KeyboardInterrupt in the main thread, so the CLI's
  `finally` runs for it exactly as for Ctrl-C (ray.init replaces the handler with one that exits 15:
  the CLI installs it again after; during ray.init that exit still runs the same `finally`).
- `stop` ignores further Ctrl-C/SIGTERM while it runs (a second Ctrl-C cannot cut the clean-up short),
  shuts Serve down only when Ray is up (serve.shutdown() on no Ray would start a new local one), shuts
  Ray down, waits a bounded time for every process this one started to exit, kills the rest by pid,
  and removes Ray's temp dir.
"""
from __future__ import annotations

import errno
import shutil
import signal
import socket


def check_port(host: str, port: int) -> None:
    """ValueError (one line) when the proxy could not listen on host:port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"{host}:{port} {why}: pick another --port (or --host)") from None


def interrupt_on_sigterm() -> None:
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


def stop(temp_dir: str | None, wait_s: float = 15.0) -> list[int]:
    """Serve and Ray down, every child process gone (waited for up to `wait_s`, then killed), the temp
    dir removed; returns the pids that had to be killed."""
    import psutil
    import ray

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    children = psutil.Process().children(recursive=True)
    try:
        if ray.is_initialized():
            from ray import serve

            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001  (Ray going down under us: the shutdown below still runs)
                pass
            ray.shutdown()
        children += [c for c in psutil.Process().children(recursive=True) if c not in children]
        _, alive = psutil.wait_procs(children, timeout=wait_s)
        killed = []
        for p in alive:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return killed
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
