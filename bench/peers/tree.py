"""One command run as a child process, its whole process tree's memory sampled while it runs.

Invariants:
- The tree is the child and every process descended from it (Ray's GCS, raylet and workers, the
  redis-server, SQL sandbox workers, TRL's process): what a user's machine holds for the command.
- Every `interval_s` the sampler sums the resident set (RSS) of every live process of the tree; the
  peak is the largest such sum, with the number of processes at that moment. RSS counts pages shared
  between processes (torch's libraries) once per process, so the sum over-counts shared memory; the
  same rule applies to both sides of the bench.
- At each new peak the per-process RSS is kept (`peak_breakdown`): which processes the peak is made of.
- Beside it, the tree's proportional set size (PSS, /proc/<pid>/smaps_rollup: each shared page split
  among the processes that map it) is summed at every sample, and its peak kept (`peak_pss_bytes`):
  what the tree holds of the machine's memory, shared libraries counted once. (0 where the kernel
  has no smaps_rollup.)
- The first time each process is seen is recorded (seconds since the start, its name): a timeline of
  what the command started, used by the start-up profile.
- The child gets its own session; `run_tree` waits at most `timeout_s`, then kills the whole tree
  (children first) and says so in the result: never a hang.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class TreeRun:
    rc: int
    start: float  # time.time() at spawn
    wall_s: float
    peak_rss_bytes: int = 0
    peak_pss_bytes: int = 0
    peak_processes: int = 0
    peak_at_s: float = 0.0
    max_processes: int = 0
    samples: int = 0
    spawned: list[tuple[float, int, str]] = field(default_factory=list)  # (s after start, pid, name)
    peak_breakdown: list[tuple[str, int]] = field(default_factory=list)  # (name, RSS bytes) at the peak, largest first
    timed_out: bool = False


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(procs: list[psutil.Process]) -> dict[int, int]:
    """pid -> RSS of every process of `procs` still alive."""
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def _pss(pids) -> int:
    """Sum of the PSS of `pids` (bytes; a process gone meanwhile counts 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            pass
    return total


def _name(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline() or [p.name()]
    except psutil.Error:
        return "?"
    head = os.path.basename(cmd[0])
    if head.startswith("python") and len(cmd) > 1:
        rest = [c for c in cmd[1:] if not c.startswith("-")][:1] or cmd[1:2]
        if "-m" in cmd:
            rest = [cmd[cmd.index("-m") + 1]] if cmd.index("-m") + 1 < len(cmd) else rest
        return f"python {os.path.basename(rest[0])}" if rest else head
    return head


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    procs = _tree(root)
    for p in reversed(procs):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def run_tree(cmd: list[str], *, cwd: str | Path | None = None, env: dict | None = None, log_path: Path | None = None,
             interval_s: float = 0.5, timeout_s: float = 3600.0, nice: int = 0) -> TreeRun:
    """Runs `cmd` (stdout+stderr to `log_path`), sampling its process tree's RSS every `interval_s`."""
    out = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
    pre = (lambda: os.nice(nice)) if nice else None
    start, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=pre)
    res = TreeRun(rc=-1, start=start, wall_s=0.0)
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not stop.is_set():
            procs = _tree(root)
            now = time.monotonic() - t0
            for p in procs:
                if p.pid not in seen:
                    seen.add(p.pid)
                    res.spawned.append((round(now, 2), p.pid, _name(p)))
            per = _rss(procs)
            rss, alive = sum(per.values()), len(per)
            res.peak_pss_bytes = max(res.peak_pss_bytes, _pss(per))
            res.samples += 1
            res.max_processes = max(res.max_processes, alive)
            if rss > res.peak_rss_bytes:
                res.peak_rss_bytes, res.peak_processes, res.peak_at_s = rss, alive, round(now, 1)
                by_pid = {p.pid: p for p in procs}  # names now: Ray's workers have taken their actor's title
                res.peak_breakdown = sorted(((_name(by_pid[pid]), b) for pid, b in per.items()), key=lambda x: -x[1])
            stop.wait(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        res.rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        res.timed_out = True
        kill_tree(proc.pid)
        res.rc = proc.wait(timeout=60)
    finally:
        res.wall_s = time.monotonic() - t0
        stop.set()
        sampler.join(timeout=10)
        if out is not subprocess.DEVNULL:
            out.close()
        # Anything of the tree still alive after the command returned (a stray Ray worker) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return res
