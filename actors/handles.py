"""Typed handles: one class per actor role whose methods make the call with that method's own bound.

The coordinator and the launcher never call an actor by a method's name: they call a method of its role's
handle (`GeneratorPool.sleep`, `LearnerHandle.train_from_stream`, `AssemblerHandle.collect`, ...), which
calls the actor's method by attribute (`g.sleep`), so a reader follows a call with "go to definition" and a
renamed method fails at attribute access, never by a string that names nothing. Each handle wraps a Ray
actor handle or the plain object itself alike (`invoke`: `.remote` where there is one, else the plain
method, awaited when it returns an awaitable), which is how the coordinator's code runs unchanged in
tests without Ray.

Invariants:
- Every call a handle makes is bounded: `CallBounds` (coordinator.call_timeout_s, on top of the wait the
  call is given itself: a generator's sleep or pause generator.pause_timeout_s; the assembler's collect,
  collect_eval and peek and the learner's training step coordinator.step_timeout_s). A call past its bound
  raises ActorCallTimeout, one line naming the actor (`generator-<i>`, `learner`, `assembler`) and the
  method, which the launcher handles as a death (launch/run.py actor_died).
- The learner group (actors/learner/group.py) bounds each rank's call itself and names the rank that did
  not answer; `LearnerHandle`'s bound is GROUP_SLACK_S later, so the group's line is the one the user reads.
- A generator is restarted in place by Ray (actors.shell.RESTARTABLE): one frozen past a control call's
  bound is killed and restarted (`GeneratorPool.restart`, actors.shell.restart_in_place) and the call made
  once more, within the bound plus call_timeout_s for the new instance to start; once per call, never
  more (past its bound again, the ActorCallTimeout goes to the launcher). Every restart is a warning naming
  the generator and the call, counted in `GeneratorPool.frozen_restarts`, and recorded once, by time, in
  `GeneratorPool.restarted_at`: the heartbeat (actors/coordinator/heartbeat.py) and WeightSync.heal's silence
  clock both read it, so a restart either of them made is never repeated by the other while the new
  instance starts.
- A handle is plain data (actor handles, numbers), so it pickles with what it wraps.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from actors.shell import ActorCallTimeout, await_within, restart_in_place
from config import CoordinatorConfig, GeneratorConfig, RunConfig

# The learner group's own bound on a rank's call is the same as ours; ours waits this much longer so the
# group's line, which names the rank, is the one raised.
GROUP_SLACK_S = 10.0
_COORDINATOR, _GENERATOR = CoordinatorConfig(), GeneratorConfig()


def method_name(method: Any) -> str:
    """The name of a plain method or of a Ray actor method (`handle.sleep`)."""
    return getattr(method, "__name__", None) or method._method_name


def submit(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Starts `method` (a Ray actor method or a plain one): Ray's ObjectRef (awaitable, and what ray.wait
    takes), or the plain method's result (a coroutine for an async one)."""
    remote = getattr(method, "remote", None)
    return remote(*args, **kwargs) if remote is not None else method(*args, **kwargs)


async def invoke(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls `method` on a Ray actor handle or a plain object alike, and awaits its result."""
    out = submit(method, *args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def bounded(method: Any, timeout_s: float, label: str, *args: Any) -> Any:
    """`invoke(method, *args)` bounded by `timeout_s`: ActorCallTimeout "<label>.<method> did not return ...".
    An error the call itself raises (a TimeoutError of its own included) passes as is."""
    return await await_within(invoke(method, *args), timeout_s, f"{label}.{method_name(method)}")


@dataclass(frozen=True)
class CallBounds:
    """The seconds a caller gives an actor's call (the module's invariant): `call_s` for a control call,
    plus the call's own wait where it has one."""

    call_s: float = _COORDINATOR.call_timeout_s
    pause_s: float = _GENERATOR.pause_timeout_s
    step_s: float = _COORDINATOR.step_timeout_s

    @classmethod
    def of(cls, cfg: RunConfig) -> "CallBounds":
        return cls(cfg.coordinator.call_timeout_s, cfg.generator.pause_timeout_s, cfg.coordinator.step_timeout_s)


def never_restart(g: Any) -> bool:
    """A pool's `restart` where a frozen generator is a death, never restarted (the launcher's calls)."""
    return False


class GeneratorPool:
    """The run's generators (Ray actor handles of actors/generator/shell.py GeneratorShell, or plain objects
    with its methods): each control call to every generator (or to `targets`) at once, each bounded,
    a frozen one restarted in place once a call (module invariant)."""

    def __init__(self, actors: list, bounds: CallBounds, *, log: Any = None,
                 restart: Callable[[Any], bool] = restart_in_place):
        self.actors, self.log, self.restart = list(actors), log, restart
        self.control_s = bounds.call_s  # wake, resume, set_version, health, receive_weights
        self.pause_s = bounds.call_s + bounds.pause_s  # sleep, pause: they wait for in-flight requests
        self.frozen_restarts = 0
        self._restarted_at: dict[str, float] = {}  # generator label -> time.monotonic() of its last restart here

    def __len__(self) -> int:
        return len(self.actors)

    def label(self, g: Any) -> str:
        return next((f"generator-{i}" for i, h in enumerate(self.actors) if h is g), "generator")

    async def _call(self, g: Any, method: Any, bound_s: float, *args: Any) -> Any:
        label = self.label(g)
        try:
            return await bounded(method, bound_s, label, *args)
        except ActorCallTimeout as e:
            if not self.restart_in_place(g, method_name(method), str(e)):
                raise
        return await bounded(method, bound_s + self.control_s, label, *args)

    def restart_in_place(self, g: Any, call: str, error: str,
                         event: str = "generator frozen past its bound: restarted in place") -> bool:
        """Restarts `g` in place (`restart`), counted in `frozen_restarts`, with one warning naming it, the call
        and why; False, and nothing done, where this pool restarts nothing (the launcher's)."""
        if not self.restart(g):
            return False
        self._restarted_at[self.label(g)] = time.monotonic()
        self.frozen_restarts += 1
        if self.log is not None:
            self.log.warning(event, generator=self.label(g), call=call, error=error)
        return True

    def restarted_at(self, g: Any) -> float:
        """time.monotonic() of `g`'s last restart in place (by any caller), 0.0 if never."""
        return self._restarted_at.get(self.label(g), 0.0)

    async def _each(self, pick: Callable[[Any], Any], bound_s: float, *args: Any, targets: list | None = None) -> list:
        """`pick(g)` (one of g's methods) called on every generator (or `targets`) at once, each bounded."""
        gens = self.actors if targets is None else targets
        return list(await asyncio.gather(*(self._call(g, pick(g), bound_s, *args) for g in gens)))

    async def sleep(self, level: int, targets: list | None = None) -> list:
        return await self._each(lambda g: g.sleep, self.pause_s, level, targets=targets)

    async def pause(self, interrupt: bool, targets: list | None = None) -> list[int]:
        """Each generator's count of requests its engine parked (interrupt) or 0."""
        return await self._each(lambda g: g.pause, self.pause_s, interrupt, targets=targets)

    async def wake(self, tags: list[str], targets: list | None = None) -> list:
        return await self._each(lambda g: g.wake, self.control_s, tags, targets=targets)

    async def set_version(self, version: int, targets: list | None = None) -> list:
        return await self._each(lambda g: g.set_version, self.control_s, version, targets=targets)

    async def resume(self, targets: list | None = None) -> list:
        return await self._each(lambda g: g.resume, self.control_s, targets=targets)

    async def restart_frozen(self) -> int:
        """A bounded health call to every generator that has one: one frozen past it is restarted in place.
        Returns how many were restarted."""
        before = self.frozen_restarts
        await self._each(lambda g: g.health, self.control_s, targets=[g for g in self.actors if _health(g)])
        return self.frozen_restarts - before

    async def health(self, g: Any, timeout_s: float) -> dict | None:
        """`g`'s health within `timeout_s` (no restart: a generator still restarting is asked next round);
        None where it has no health call (a plain Generator in a bench)."""
        method = _health(g)
        return None if method is None else await bounded(method, timeout_s, self.label(g))

    def receivers(self, targets: list | None = None) -> list[Callable[[Any], Awaitable[Any]]]:
        """Each generator's weight-sync verb (receive_weights), bounded."""
        def receiver(g: Any) -> Callable[[Any], Awaitable[Any]]:
            return lambda call: bounded(g.receive_weights, self.control_s, self.label(g), call)
        return [receiver(g) for g in (self.actors if targets is None else targets)]

    # -- the launcher's calls ----------------------------------------------------------------------

    def start_loops(self) -> list:
        """Starts every generator's consumer loop (run): Ray's refs, which end when the loop does."""
        return [submit(g.run) for g in self.actors]

    async def started(self, timeout_s: float) -> list[int]:
        """Every generator's pid, within `timeout_s` (its engine's start-up done)."""
        return list(await asyncio.gather(*(bounded(g.pid, timeout_s, self.label(g)) for g in self.actors)))


def _health(g: Any) -> Any:
    try:
        return g.health
    except AttributeError:  # a plain Generator (bench/async_modes): nothing to heal
        return None


class LearnerHandle:
    """The learner as the coordinator calls it: actors/learner/group.py LearnerGroup (which bounds each
    rank), a LearnerShell's Ray handle, or a plain LearnerShell (tests)."""

    def __init__(self, actor: Any, bounds: CallBounds):
        self.actor = actor
        self.control_s = bounds.call_s + GROUP_SLACK_S
        self.step_s = bounds.call_s + bounds.step_s + GROUP_SLACK_S  # train_from_stream

    async def wake(self) -> None:
        await bounded(self.actor.wake, self.control_s, "learner")

    async def sleep(self) -> None:
        await bounded(self.actor.sleep, self.control_s, "learner")

    async def train_from_stream(self, step: int) -> dict[str, float]:
        return await bounded(self.actor.train_from_stream, self.step_s, "learner", step)

    async def save(self, path: str) -> str:
        return await bounded(self.actor.save, self.control_s, "learner", path)

    async def load(self, path: str) -> int:
        return await bounded(self.actor.load, self.control_s, "learner", path)

    async def export_hf(self, path: str) -> str:
        return await bounded(self.actor.export_hf, self.control_s, "learner", path)

    def sender(self) -> Callable[[Any], Awaitable[Any]]:
        """The learner's weight-sync verb (send_weights), bounded."""
        return lambda call: bounded(self.actor.send_weights, self.control_s, "learner", call)


class AssemblerHandle:
    """The assembler (actors/assembler.py Assembler: its Ray handle or the plain object)."""

    def __init__(self, actor: Any, bounds: CallBounds):
        self.actor = actor
        self.control_s = bounds.call_s  # start, forget_before
        self.collect_s = bounds.call_s + bounds.step_s  # collect, collect_eval, peek: they wait for groups

    async def start(self) -> None:
        await bounded(self.actor.start, self.control_s, "assembler")

    async def collect(self, step: int, task_ids: list[str], version: int, timeout_s: float) -> dict[str, Any]:
        return await bounded(self.actor.collect, self.collect_s, "assembler", step, task_ids, version, timeout_s)

    async def collect_eval(self, task_ids: list[str], timeout_s: float) -> dict[str, float]:
        return await bounded(self.actor.collect_eval, self.collect_s, "assembler", task_ids, timeout_s)

    async def peek(self, task_ids: list[str], version: int, timeout_s: float) -> dict[str, str]:
        return await bounded(self.actor.peek, self.collect_s, "assembler", task_ids, version, timeout_s)

    async def forget_before(self, step: int) -> None:
        await bounded(self.actor.forget_before, self.control_s, "assembler", step)


class ScorerPool:
    """The run's scorers (actors/scorer.py ScorerShell): the launcher starts their consumer loops."""

    def __init__(self, actors: list):
        self.actors = list(actors)

    def start_loops(self) -> list:
        """Starts every scorer's consumer loop (run): Ray's refs, which end when the loop does."""
        return [submit(s.run) for s in self.actors]


class CoordinatorHandle:
    """The coordinator as the launcher drives it (actors/coordinator/coordinator.py Coordinator): its long
    calls are started (`submit`: refs the launcher watches, pinging `ping` meanwhile), the rest bounded."""

    def __init__(self, actor: Any, bounds: CallBounds):
        self.actor, self.control_s = actor, bounds.call_s

    async def attach_metrics(self) -> None:
        await bounded(self.actor.attach_metrics, self.control_s, "coordinator")

    def start_resume(self, checkpoint: Any) -> Any:
        return submit(self.actor.resume_from, checkpoint)

    def start_initial_sync(self, warm_start_metrics: dict[str, float]) -> Any:
        return submit(self.actor.initial_sync, warm_start_metrics)

    def start_run(self) -> Any:
        return submit(self.actor.run)

    def ping(self) -> Any:
        """The liveness ping (its pid), started."""
        return submit(self.actor.pid)
