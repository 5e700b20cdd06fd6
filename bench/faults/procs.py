"""The launcher's process tree, as the fault benches see it: a launch in its own session, its descendants, and
its actors found by Ray's process titles (bench/faults/chaos.py, soak.py and the tests that kill processes).

Invariants: everything is read from /proc (no Ray API: the benches kill what Ray would be asked about);
`Launch.wait` is bounded and kills the launch's whole session at its bound; `leftovers` names every descendant
ever seen that outlived the launcher.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TITLES = {"generator": "ray::GeneratorShell", "scorer": "ray::ScorerShell", "assembler": "ray::Assembler",
          "learner": "ray::LearnerShell", "coordinator": "ray::Coordinator", "redis": "redis-server"}


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every live, non-zombie process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z":
                continue
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(d)] = (int(fields[1]), cmd)
        except (OSError, ValueError):
            continue
    return out


def descendants(root: int) -> dict[int, str]:
    procs = _procs()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = procs[c][1]
            todo.append(c)
    return out


def find_pids(root: int, kind: str) -> list[int]:
    title = TITLES[kind]
    return sorted(p for p, cmd in descendants(root).items() if cmd.startswith(title) or
                  (kind == "redis" and title in cmd.split(" ")[0]))


def alive(pids) -> list[int]:
    live = _procs()
    return [p for p in pids if p in live]


class Launch:
    """`python -m launch.cluster tiny ...` in its own session; remembers every descendant seen."""

    def __init__(self, overrides: list[str], log_path: Path):
        self.log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", "tiny", *overrides], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.seen: set[int] = set()
        self.started = time.monotonic()

    def watch(self) -> None:
        self.seen.update(descendants(self.proc.pid))

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.2)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -9
        return self.proc.returncode

    def leftovers(self, grace_s: float = 10.0) -> list[int]:
        """Descendants still alive after the launcher exited (there should be none)."""
        deadline = time.monotonic() + grace_s
        while True:
            left = alive(self.seen)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)
