"""Resident memory of a launch's process tree over a long run (bench/faults/soak.py): per process, its first
sample once warm and its last, so a leak shows as growth between them.

Invariants: read from /proc alone; a process is judged only from a warm sample (at least `warm_s` after it was
first seen, and after the run's first step) to its last, and only if it was alive at the end and lived
`min_life_s` between them; each process is named by its role (Ray's actor title, `python -m <module>`, or the
executable), never by its pid alone.
"""
from __future__ import annotations

import os

from bench.faults.procs import descendants

RSS_WARM_S = 60.0
RSS_EVERY_S = 20.0


def _rss_kb(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _name(cmd: str) -> str:
    """A process's role: Ray's title (ray::Coordinator), `python <script or module>`, or the executable."""
    words = cmd.split(" ")
    if words[0].startswith("ray::"):
        # ray::<Class>[.<method running>], or ray::<run>:relaunch<k>:<role>:<Class>[.<method>] for a named actor
        parts = words[0][len("ray::"):].split(".", 1)[0].split(":")
        return f"ray::{parts[-1]}" + (f" ({parts[-2]})" if len(parts) > 1 else "")
    base = os.path.basename(words[0])
    if base.startswith("python"):
        if "-m" in words[1:-1]:
            return f"python -m {words[words.index('-m') + 1]}"
        if "multiprocessing" in cmd:
            return "python (multiprocessing child: sandbox/executor worker)"
        script = next((w for w in words[1:] if w.endswith(".py")), "")
        return f"python {os.path.basename(script)}".strip()
    return base or "?"


class RssLog:
    """Per process of the launcher's tree (the launcher included): its first sample once it is `warm_s`
    old (as seen here) and after `warm_after`, and its last sample."""

    def __init__(self, warm_s: float = RSS_WARM_S):
        self.procs: dict[int, dict] = {}
        self.warm_s = warm_s

    def sample(self, root: int, now: float, warm_after: float) -> None:
        try:
            own = {root: open(f"/proc/{root}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")}
        except OSError:
            own = {}
        for pid, cmd in {**own, **descendants(root)}.items():
            rss = _rss_kb(pid)
            if rss is None:
                continue
            p = self.procs.setdefault(pid, {"name": _name(cmd), "seen": now, "start_kb": None, "start_t": None})
            if p["start_kb"] is None and now - p["seen"] >= self.warm_s and now >= warm_after:
                p["start_kb"], p["start_t"] = rss, now
            p["end_kb"], p["end_t"] = rss, now

    def report(self, end_t: float, min_life_s: float) -> list[dict]:
        """Processes sampled warm and alive at the end, that lived at least min_life_s between."""
        out = []
        for pid, p in sorted(self.procs.items(), key=lambda kv: kv[1]["name"]):
            if p["start_kb"] is None or end_t - p["end_t"] > 2 * RSS_EVERY_S or p["end_t"] - p["start_t"] < min_life_s:
                continue
            out.append({"pid": pid, "name": p["name"], "minutes": round((p["end_t"] - p["start_t"]) / 60, 1),
                        "start_mb": round(p["start_kb"] / 1024, 1), "end_mb": round(p["end_kb"] / 1024, 1),
                        "growth_pct": round(100 * (p["end_kb"] - p["start_kb"]) / p["start_kb"], 1)})
        return out
