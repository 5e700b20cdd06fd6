"""One way to make a Ray actor out of a plain class, used by every actor of a run.

Each actor is a plain class (`Coordinator`, `Assembler`, `ScorerShell`, `GeneratorShell`,
`LearnerShell`, the preflight `Probe`): importable and testable without Ray. `ray_actor(cls)` turns
it into Ray's actor class; the launcher adds placement, names and restarts with `.options(...)`.

Invariants:
- Importing this module imports no Ray; `ray_actor` imports it on first use.
- `ray_actor(cls)` is memoised per class, so every caller gets the same actor class (Ray exports a
  class once per job).
- What the class itself needs to run correctly (e.g. the generator's `max_concurrency` for its
  control calls beside its loop) is the class attribute `RAY_OPTIONS`; where it runs is the caller's.
- The actor's process title is `ray::<class name>` (what bench/chaos targets).
- `call(handle, method, ...)` awaits a method alike on a Ray actor handle or on the plain object
  itself, which is how the coordinator's code runs unchanged in tests without Ray.
"""
from __future__ import annotations

import asyncio
from typing import Any

_ACTORS: dict[type, Any] = {}


def ray_actor(cls: type) -> Any:
    """Ray's actor class for the plain class `cls` (with its RAY_OPTIONS)."""
    actor = _ACTORS.get(cls)
    if actor is None:
        import ray

        options = dict(getattr(cls, "RAY_OPTIONS", {}) or {})
        actor = ray.remote(**options)(cls) if options else ray.remote(cls)
        _ACTORS[cls] = actor
    return actor


async def call(handle: Any, method: str, *args, **kwargs) -> Any:
    """Calls a method on a Ray actor handle or a plain object alike (plain objects in tests)."""
    fn = getattr(handle, method)
    if hasattr(fn, "remote"):
        return await fn.remote(*args, **kwargs)
    out = fn(*args, **kwargs)
    return await out if asyncio.iscoroutine(out) else out
