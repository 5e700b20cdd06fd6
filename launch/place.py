"""Places one run and drives it to its end: creates its actors (launch/create.py), starts their stream
loops, builds the coordinator (its process started beside the others), drives the warm start (or the resume), the initial sync and the
coordinator's loop, then stops every actor and removes the placement groups.

Restart policy (on the classes, RAY_OPTIONS): generators, scorers and the assembler are restarted by
Ray when they die, and their in-flight calls (their stream loops) are retried on the new instance,
which first takes back the messages it held (same consumer name) — so a death costs time, never
data. The learner and the coordinator hold training state: they are not restarted in place; a run
that loses them continues with `coordinator.resume=true` from the last checkpoint.

Start-up order: the warm start begins only once every engine is built (its start-up profile done,
where a learner rank shares its GPU with an engine); a colocated warm start runs with the engines
asleep. Each start-up phase boundary is logged with its device memory (launch/startup_memory.py: one
`start-up memory` line per phase in logs/launcher.jsonl).

The groups live as long as one place_and_run: removed when it returns or raises, so a relaunch places
afresh; before they go, stop_actors ends the actors in order (a group removed under live restartable
actors restarts them instead).

Frozen actors (alive to Ray, silent: SIGSTOP, a stuck device, a lost node): every wait here is bounded
by coordinator.call_timeout_s (the typed handles of actors/handles.py; the coordinator and the learner
group bound their own calls; the coordinator itself answers a liveness ping, `watch_coordinator`). A
wait past its bound raises ActorCallTimeout naming the actor and the call, which launch/run.py
handles as a death.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from actors.handles import AssemblerHandle, CallBounds, CoordinatorHandle, GeneratorPool, ScorerPool, never_restart
from actors.shell import ActorCallTimeout, spawn
from config import RunConfig, RunContext, layout
from launch.create import create_actors, wait_built
from launch.groups import actor_options, remove_groups
from launch.startup_memory import StartupMemory
from launch.warm_start import warm_start, will_warm_start


def place_and_run(cfg: RunConfig, ctx: RunContext, model_path: str, train_items: list, eval_items: list, log,
                  names: str = "", draws=None) -> dict[str, Any]:
    """`draws`: the warm start's (launch.warm_start.Draws, made in the inputs' child process), else the warm
    start draws them here."""
    names = names or ctx.run_id
    memory = StartupMemory(log, cfg.cluster.gpus_per_node > 0)
    learner, generators, scorers, assembler, placement, groups = create_actors(
        cfg, ctx, model_path, cfg.coordinator.steps, names, memory=memory)
    try:
        return _drive(cfg, ctx, model_path, train_items, eval_items, log, names,
                      (learner, generators, scorers, assembler), placement, groups, memory, draws)
    finally:
        remove_groups(groups)  # a relaunch places its own; removing a group also ends the actors in it


def _drive(cfg: RunConfig, ctx: RunContext, model_path: str, train_items: list, eval_items: list, log, names: str,
           actors: tuple, placement, groups: list, memory: StartupMemory | None = None, draws=None) -> dict[str, Any]:
    import asyncio

    from actors.coordinator.coordinator import Coordinator

    learner, generators, scorers, assembler = actors
    loops: list = []
    coordinator = None
    try:
        bounds = CallBounds.of(cfg)
        # The coordinator's process starts while the others build (its constructor calls no actor): its
        # start-up is off the path to the first step.
        coordinator = CoordinatorHandle(spawn(
            Coordinator, cfg, ctx, options=dict(name=f"{names}:coordinator", **actor_options(placement.actor("coordinator"), groups)),
            train_items=train_items, eval_items=eval_items, generators=generators, learner=learner,
            assembler=assembler), bounds)
        wait_built({**{f"generator-{i}": g for i, g in enumerate(generators)},
                    **{f"scorer-{i}": s for i, s in enumerate(scorers)}, "assembler": assembler,
                    **{f"learner rank {r}": h for r, h in enumerate(learner.ranks)}})
        pool = GeneratorPool(generators, bounds, restart=never_restart)  # here a frozen generator is a death
        loops += pool.start_loops() + ScorerPool(scorers).start_loops()
        asyncio.run(AssemblerHandle(assembler, bounds).start())
        asyncio.run(learner.connect())  # the group bounds its ranks' calls
        if placement.gpu_shared:  # the learner trains (warm start) only once every engine's start-up profile is done
            from launch.startup_memory import STARTUP_TIMEOUT_S

            asyncio.run(pool.started(STARTUP_TIMEOUT_S))
        memory = memory or StartupMemory(log, False)
        memory.mark("engines built", learner, generators)
        wait_built({"coordinator": coordinator.actor})
        return _drive_coordinator(cfg, Path(ctx.run_dir), model_path, train_items, log, learner, pool,
                                  coordinator, loops, memory, draws)
    finally:
        stop_actors(names, generators, scorers, assembler, learner, coordinator and coordinator.actor, loops, log)


def _drive_coordinator(cfg: RunConfig, run_dir: Path, model_path: str, train_items: list, log, learner,
                       generators: GeneratorPool, coordinator: CoordinatorHandle, loops: list,
                       memory: StartupMemory | None = None, draws=None) -> dict[str, Any]:
    """Warm start (or resume), the initial sync, then the coordinator's loop to its end, watching the
    stream loops (one that ends on its own is an error) and the coordinator's liveness (watch_coordinator).
    `memory` marks the start-up phases. Every wait is bounded: the coordinator and the learner group bound
    their own calls, the rest here."""
    import asyncio

    from actors.coordinator.checkpoint import Checkpoints
    from launch.progress import Progress

    memory = memory or StartupMemory(log, False)
    bound = cfg.coordinator.call_timeout_s
    asyncio.run(coordinator.attach_metrics())
    latest = Checkpoints.latest(run_dir) if cfg.coordinator.resume else None
    if latest is not None:
        log.info("resuming", checkpoint=str(latest))
        watch_coordinator(coordinator, coordinator.start_resume(latest), bound, loops)
    else:
        if cfg.coordinator.mode == "colocated" and will_warm_start(cfg):
            # The warm start trains with the engines asleep (weights and KV released), never beside a
            # resident engine: the device's start-up peak stays that of a training step, not both at once.
            asyncio.run(generators.sleep(cfg.generator.sleep_level))
            memory.mark("engines asleep", learner, generators.actors)
        sft = warm_start(cfg, learner, train_items, model_path, log, draws=draws)
        if sft:
            memory.mark("warm start done", learner, generators.actors)
        watch_coordinator(coordinator, coordinator.start_initial_sync(sft), bound, loops)
        memory.mark("initial sync done", learner, generators.actors)
    metrics = layout.metrics_file(run_dir)  # a resumed run prints only its own rows
    progress = Progress(run_dir, cfg.coordinator.steps,
                        seen=len(metrics.read_text().splitlines()) if cfg.coordinator.resume and metrics.exists() else 0)
    summary = watch_coordinator(coordinator, coordinator.start_run(), bound, loops, on_tick=progress.print_new)
    progress.print_new()
    return summary



# The launcher asks the coordinator for its pid this often while a long call of it runs.
PING_EVERY_S = 10.0


def watch_coordinator(coordinator: CoordinatorHandle, ref, ping_timeout_s: float, loops: list, on_tick=None,
                      every_s: float = PING_EVERY_S) -> Any:
    """ray.get(ref) of a long coordinator call (resume_from, initial_sync, run), whose calls to other actors
    are bounded by the coordinator itself. Meanwhile: a stream loop in `loops` that ended with an error
    raises it; the coordinator is pinged every `every_s`, and a ping unanswered after `ping_timeout_s`
    (coordinator.call_timeout_s: a frozen coordinator) raises ActorCallTimeout."""
    import ray

    loops = list(loops)
    ping, next_ping = None, time.monotonic() + every_s
    while True:
        ready, _ = ray.wait([ref] + loops, timeout=1.0)
        if on_tick is not None:
            on_tick()
        if ref in ready:
            return ray.get(ref)
        for r in ready:  # a stream loop that ended on its own is an error (a clean end is watched no more)
            loops.remove(r)
            ray.get(r)
        now = time.monotonic()
        if ping is None and now >= next_ping:
            ping = (coordinator.ping(), now)
        if ping is not None:
            if ray.wait([ping[0]], timeout=0)[0]:
                ray.get(ping[0])
                ping, next_ping = None, now + every_s
            elif now - ping[1] > ping_timeout_s:
                raise ActorCallTimeout.of("coordinator.pid (the launcher's liveness ping)", ping_timeout_s)


# ---------------------------------------------------------------------------------------------
# Orderly end: consumers stopped and drained, engines closed, every actor killed for good


def stop_actors(names: str, generators: list, scorers: list, assembler, learner, coordinator, loops: list, log,
                timeout_s: float = 30.0) -> dict[str, Any]:
    """Ends a run's actors in order, before their placement groups go (and before ray.shutdown):
    the consumers stop pulling (generators, scorers, the assembler) and their loops return (bounded by
    `timeout_s`: what is left is in Redis for a resumed run), the engines of those that answered close
    (vLLM's engine core exits with its own shutdown; a frozen actor is not waited for twice), then every actor of the run is killed with no_restart and none is
    left alive. Removing a placement group under live restartable actors instead restarts them and
    fails their running tasks ("Task ... failed ... The actor was restarted" from the raylet) and can
    leave them pending in a cluster the run joined. Never raises (teardown goes on); logs one line."""
    import ray

    t0 = time.monotonic()
    consumers = [a for a in [*generators, *scorers, assembler] if a is not None]
    out: dict[str, Any] = {"loops": len(loops)}
    try:
        stops = [a.stop.remote() for a in consumers]
        answered, _ = ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        done, _ = ray.wait(loops, num_returns=len(loops), timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
        out["loops_drained"] = len(done)
        # An actor that did not answer its stop (frozen: the relaunch after an ActorCallTimeout) is not asked to
        # close as well: that wait would run out too (2 x timeout_s before), and the kill below ends it.
        live = {a for a, ref in zip(consumers, stops) if ref in set(answered)}
        out["unresponsive"] = len(consumers) - len(live)
        closes = [a.close.remote() for a in [*generators, *scorers] if a in live]
        ray.wait(closes, num_returns=len(closes), timeout=timeout_s)
        handles = [a for a in [*consumers, coordinator] if a is not None]
        for a in handles:
            ray.kill(a, no_restart=True)
        if learner is not None:
            learner.kill()
            handles += learner.ranks
        out["killed"] = len(handles) + kill_run_actors(names, timeout_s=timeout_s)  # + any the handles missed
        out["alive"] = len(run_actor_names(names))
    except Exception as e:  # noqa: BLE001 - teardown goes on (placement groups, ray.shutdown, redis)
        from queues.errors import one_line

        out["error"] = one_line(e)
    out["s"] = round(time.monotonic() - t0, 2)
    (log.warning if "error" in out or out.get("loops_drained") != len(loops) else log.info)("actors stopped", **out)
    return out


def run_actor_names(prefix: str) -> list[str]:
    """The live named actors of a run (`<prefix>:...`)."""
    import ray

    named = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=False)]
    return [n for n in named if n.startswith(f"{prefix}:")]


def kill_run_actors(run_id: str, timeout_s: float = 60.0) -> int:
    """Kills every live named actor of the run (`<run_id>:...`) for good and waits until Ray lists
    none. (A dead actor's name stays taken while a handle to it lives: a relaunch uses new names.)"""
    import ray

    killed = run_actor_names(run_id)
    for name in killed:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except ValueError:  # already gone
            pass
    deadline = time.monotonic() + timeout_s
    while run_actor_names(run_id):
        if time.monotonic() > deadline:
            raise RuntimeError(f"actors of run {run_id} still alive {timeout_s:.0f} s after ray.kill: "
                               f"{run_actor_names(run_id)}")
        time.sleep(0.2)
    return len(killed)

