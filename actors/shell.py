"""One way to make a Ray actor out of a plain class, used by every actor of a run.

Each actor of a run is a plain class (`Coordinator`, `Assembler`, `ScorerShell`, `GeneratorShell`,
`LearnerShell`), importable and testable without Ray, and constructed one way:
`cls(section, ctx, **specifics)` -- its config section (the coordinator: the whole RunConfig), the
run's config.context.RunContext (run id, run dir, Redis URL, logging, stream settings) and what only
it takes (a model path, its GPU ids, its rank). It sets up its logging from `ctx` in its constructor
(observe.logs.setup_actor_logging) and reaches Redis through `ctx.redis_url` alone. The launcher
builds every one with `spawn` (launch/create.py; the coordinator in launch/place.py); `ray_actor(cls)` is Ray's actor class (the
preflight `Probe` uses it too).

Invariants:
- Importing this module imports no Ray; `ray_actor` imports it on first use.
- `ray_actor(cls)` is memoised per class, so every caller gets the same actor class (Ray exports a
  class once per job).
- What the class itself needs to run correctly is the class attribute `RAY_OPTIONS`: e.g. the
  generator's `max_concurrency` for its control calls beside its loop, and `RESTARTABLE` for the
  stages whose state survives a Ray restart (generators, scorers, the assembler: a restarted one takes
  back its pending messages; the learner and the coordinator are relaunched from a checkpoint
  instead). Where it runs (name, resources, bundle) is the caller's `.options`.
- The actor's process title is `ray::<class name>` (what bench/faults/chaos targets).
- Every actor builds with Python's cyclic garbage collector paused (`built_with_gc_paused` on its
  constructor, and on the learner's `join`): the collector re-enabled as it was when the build ends, raised
  or not; in an actor's process, a build that returned ends with one full collection, then what is
  left alive is frozen (gc.freeze), so no later collection walks the modules and the model again.
- Callers reach an actor through its role's typed handle (actors/handles.py), never by a method's name.
- Every wait on an actor has a bound: `await_within` (the handles' calls) ends a call that did not
  return in time with `ActorCallTimeout`, one line naming the actor and the call. A frozen
  actor (SIGSTOP, a stuck device, a lost node) is not dead to Ray, so nothing else would end the wait;
  the launcher treats the timeout as a death (launch/run.py actor_died: relaunch or one line), except
  for a RESTARTABLE stage the caller restarts in place (`restart_in_place`: Ray kills the frozen
  process and starts the actor again; its pending messages are taken back by the new instance).
"""
from __future__ import annotations

import asyncio
import functools
import gc
import sys
from typing import Any, Callable

_ACTORS: dict[type, Any] = {}

# A stage that Ray restarts in place after a crash, retrying the calls in flight on the new instance.
RESTARTABLE = {"max_restarts": -1, "max_task_retries": -1}


def ray_actor(cls: type) -> Any:
    """Ray's actor class for the plain class `cls` (with its RAY_OPTIONS)."""
    actor = _ACTORS.get(cls)
    if actor is None:
        import ray

        options = dict(getattr(cls, "RAY_OPTIONS", {}) or {})
        actor = ray.remote(**options)(cls) if options else ray.remote(cls)
        _ACTORS[cls] = actor
    return actor


def built_with_gc_paused(build: Callable) -> Callable:
    """`build` (an actor's constructor, or the learner's `join`) run with the cyclic garbage collector
    paused, the collector back as it was after (raised or not); in a Ray actor's process, a build that
    returned ends with one full collection and then freezes what is left alive (gc.freeze).

    Importing torch and transformers and loading a model make ~400,000 long-lived objects; with the
    collector on, its thresholds trip over and over while they are made and each full pass walks them
    all: in tiny's learner and generator about 1.8 of the 4.6 CPU-s from the process's start to its first
    step (docs/perf/peers.md, "Start-up"). The one collection at the end (~0.3 CPU-s there) frees what the
    build dropped in reference cycles (~11,000 objects after the imports alone; a large model's load could
    leave tensors among them), so nothing but live objects is frozen; frozen, no later pass walks them
    again. Only an actor's process freezes: there the build is the process's own start, whereas a test
    that builds an actor in its own process goes on to drop it."""

    @functools.wraps(build)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            out = build(*args, **kwargs)
            if in_actor_process():
                gc.collect()
                gc.freeze()
            return out
        finally:
            if was:
                gc.enable()

    return paused


def in_actor_process() -> bool:
    """Whether this process is a Ray actor's (Ray imported here, its runtime context names an actor)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # noqa: BLE001 - a driver, or a Ray half torn down: not an actor
        return False


def spawn(cls: type, section: Any, ctx: Any, *, options: dict[str, Any] | None = None, **specifics) -> Any:
    """The Ray actor `cls(section, ctx, **specifics)`, with the class's RAY_OPTIONS and the caller's
    `options` (name, resources, scheduling strategy)."""
    return ray_actor(cls).options(**(options or {})).remote(section, ctx, **specifics)


class ActorCallTimeout(RuntimeError):
    """A call to an actor that did not return within its bound: the actor is frozen or overloaded."""

    @classmethod
    def of(cls, what: str, timeout_s: float) -> "ActorCallTimeout":
        return cls(f"{what} did not return within {timeout_s:g} s (the actor is frozen or overloaded)")


async def await_within(awaitable: Any, timeout_s: float, what: str) -> Any:
    """`awaitable` bounded by `timeout_s`: its result, or ActorCallTimeout naming `what` (actor.method).
    An error the awaitable itself raises (a TimeoutError of its own included) passes as is."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()  # timed out, or our caller was cancelled: stop awaiting (a Ray task goes on)
    if not done:
        raise ActorCallTimeout.of(what, timeout_s)
    return task.result()


def restart_in_place(handle: Any) -> bool:
    """Kills a frozen RESTARTABLE actor's process so that Ray starts the actor again under the same handle
    (a SIGSTOPped process is killed all the same). False, and nothing done, where `handle` is not a Ray
    actor (a plain object in tests)."""
    if not hasattr(handle, "_actor_id"):
        return False
    import ray

    ray.kill(handle, no_restart=False)
    return True

