"""Device memory at each start-up phase boundary of a GPU run, logged as scalars (issue 25, point 3).

The launcher marks each boundary it drives (launch/create.py, launch/place.py): "learner built" and
"learner asleep" (where a learner rank shares its GPU with an engine, the learner is built and put to
sleep before any engine starts), "engines built", "engines asleep" (colocated, before the warm start), "warm start done"
and "initial sync done" (just before step 1). Each mark is one `start-up memory` line in the launcher's
log (logs/launcher.jsonl) whose fields besides `phase` are scalars in GiB (`startup_row`):
    learner_allocated/reserved_gib       rank 0's caching allocator now
    learner_max_allocated/reserved_gib   its peaks since the previous mark (the peak inside the phase)
    engine_*                             the same for generator 0's engine (vLLM: its first worker)
    device_used_gib                      the whole GPU (every process on it, as nvidia-smi counts),
                                         from the learner's process where it answered, else the engine's

Invariants: a mark never fails the run and never waits past `timeout_s` (an actor that does not answer
is named in the line and the run goes on: its own failure surfaces where it did before); CPU recipes
mark nothing (no device to report); every mark is also kept in `rows` (tests, benches).
"""
from __future__ import annotations

from typing import Any

STARTUP_TIMEOUT_S = 1800.0  # an engine's or a learner's build (model load, vLLM's profile) may take minutes


def startup_row(phase: str, learner: dict[str, float] | None, engine: dict[str, float] | None) -> dict[str, Any]:
    """One mark's fields: the phase, then `learner_<k>` and `engine_<k>` (rounded GiB) and `device_used_gib`."""
    row: dict[str, Any] = {"phase": phase}
    for who, stats in (("learner", learner), ("engine", engine)):
        for k, v in sorted((stats or {}).items()):
            if k != "device_used_gib":
                row[f"{who}_{k}"] = round(float(v), 3)
    used = (learner or {}).get("device_used_gib", (engine or {}).get("device_used_gib"))
    if used is not None:
        row["device_used_gib"] = round(float(used), 3)
    return row


class StartupMemory:
    """Marks start-up phases (module docstring). `enabled`: a GPU recipe."""

    def __init__(self, log, enabled: bool, timeout_s: float = STARTUP_TIMEOUT_S):
        self.log, self.enabled, self.timeout_s = log, bool(enabled), float(timeout_s)
        self.rows: list[dict[str, Any]] = []

    def mark(self, phase: str, learner: Any = None, generators: list | tuple = ()) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        import asyncio

        import ray

        missing = []
        got_learner = got_engine = None
        if learner is not None:
            try:
                got_learner = asyncio.run(asyncio.wait_for(learner.memory(), self.timeout_s))
            except Exception as e:  # noqa: BLE001 - a mark never fails the run
                missing.append(f"learner ({type(e).__name__})")
        if generators:
            try:
                got_engine = ray.get(generators[0].memory.remote(), timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001
                missing.append(f"generator-0 ({type(e).__name__})")
        row = startup_row(phase, got_learner, got_engine)
        self.rows.append(row)
        self.log.info("start-up memory", **row, **({"missing": ", ".join(missing)} if missing else {}))
        return row
