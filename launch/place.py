"""Creates the actors of one run, starts their loops and drives the coordinator to the end.

Construction: every actor is built one way (actors/shell.py `spawn`): its config section, the run's
one config.context.RunContext (run id, run dir, Redis URL, logging, stream settings; launch/run.py
makes it) and its specifics -- here and nowhere else (the learner's ranks too: create_learner).

Restart policy (on the classes, RAY_OPTIONS): generators, scorers and the assembler are restarted by
Ray when they die, and their in-flight calls (their stream loops) are retried on the new instance,
which first takes back the messages it held (same consumer name) — so a death costs time, never
data. The learner and the coordinator hold training state: they are not restarted in place; a run
that loses them continues with `coordinator.resume=true` from the last checkpoint.

Placement: every actor is created with the Ray options of its slot in
config.placement.make_placement(cfg) (`actor_options`), the function --dry-run renders and --preflight
builds. GPU recipes get one STRICT_PACK placement group per plan node, ready within
cluster.placement_timeout_s or a one-line PlacementFailed naming the plan node (and any dead Ray
node); a generator gets `device_ids`, the GPU ids Ray gave its TP bundles (found by a tiny task in
each bundle). The groups live as long as one place_and_run: removed when it returns or raises, so a
relaunch places afresh. CPU recipes use no group; their CPU requests must fit the cluster's CPUs
(else PlacementFailed at once, not an actor pending forever).

Start-up order: where a learner rank shares its GPU with an engine (colocated, or async on shared GPUs),
the learner is built and asleep before any engine is created (create_actors), and the warm start begins
only once every engine is built (its start-up profile done); a colocated warm start runs with the engines
asleep. Each start-up phase boundary is logged with its device memory
(launch/startup_memory.py: one `start-up memory` line per phase in logs/launcher.jsonl).

Frozen actors (alive to Ray, silent: SIGSTOP, a stuck device, a lost node): every wait here is bounded
by coordinator.call_timeout_s (actors.shell.get_within / call_within; the coordinator and the learner
group bound their own calls; the coordinator itself answers a liveness ping, `watch_coordinator`). A
wait past its bound raises ActorCallTimeout naming the actor and the call, which launch/run.py
handles as a death.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from actors.shell import ActorCallTimeout, call_within, get_within, spawn
from config import RunConfig, RunContext
from config import layout
from launch.startup_memory import StartupMemory
from launch.warm_start import warm_start, will_warm_start


def create_actors(cfg: RunConfig, ctx: RunContext, model_path: str, total_steps: int, names: str = "",
                  memory: StartupMemory | None = None):
    """The run's actors, named `<names>:learner-<rank>` etc. (names: the run id, or the run id and the
    relaunch: Ray keeps a dead actor's name while a handle to it lives), each built the one way
    (actors.shell.spawn: its config section, the run's `ctx`, its specifics) with the Ray options of
    its slot in config.placement.make_placement(cfg) -- the placement --dry-run prints and --preflight
    builds. The learner is a LearnerGroup of the placement's world size (learner.num_ranks on CPU).
    Where a learner rank shares its GPU with an engine (`placement.gpu_shared`: colocated, or async on
    shared GPUs) the learner is built and put to sleep (optimizer state to the host where configured,
    its allocator's cache emptied) BEFORE any engine starts: vLLM sizes its KV cache from the device's
    memory during its start-up profile, so a learner allocating or freeing on the same GPU meanwhile
    would skew it, and the learner's build-time optimizer state (DeepSpeed steps Adam once at build)
    would sit beside the engine's whole fraction (the 51.5 GiB start-up peak of issue 25).
    Returns (learner, generators, scorers, assembler, placement, groups); the caller removes `groups`."""
    import asyncio

    import structlog

    names = names or ctx.run_id

    from actors import assembler as assembler_module, scorer as scorer_module
    from actors.generator import shell as generator_module
    from config.placement import make_placement

    placement = make_placement(cfg)
    if placement.errors:
        raise PlacementFailed(placement.errors[0])
    check_cpus(placement)
    groups = build_placement_groups(placement, cfg.cluster.placement_timeout_s, name=names)
    try:
        gpu_ids = bundle_gpu_ids(placement, groups, cfg.cluster.placement_timeout_s) if groups else {}
        ranks = placement.by_role("learner")
        learner = create_learner(cfg, ctx, model_path, total_steps, names,
                                 rank_options=[actor_options(r, groups) for r in ranks])
        memory = memory or StartupMemory(structlog.get_logger("arctic_rl.launcher"), placement.gpu)
        if placement.gpu_shared:
            from actors.learner.group import JOIN_TIMEOUT_S

            memory.mark("learner built", learner)
            asyncio.run(asyncio.wait_for(learner.sleep(), JOIN_TIMEOUT_S))
            memory.mark("learner asleep", learner)
        colocated = cfg.coordinator.mode == "colocated"
        generators = [spawn(generator_module.GeneratorShell, cfg.generator, ctx,
                            options=dict(name=f"{names}:{slot.name}", **actor_options(slot, groups)),
                            model_cfg=cfg.model, model_path=model_path, generator_id=f"generator-{i}",
                            colocated=colocated, device_ids=device_ids(slot, gpu_ids))
                      for i, slot in enumerate(placement.by_role("generator"))]
        scorers = [spawn(scorer_module.ScorerShell, cfg.scorer, ctx,
                         options=dict(name=f"{names}:{slot.name}", **actor_options(slot, groups)), scorer_id=slot.name)
                   for slot in placement.by_role("scorer")]
        assembler = spawn(assembler_module.Assembler, cfg.assembler, ctx,
                          options=dict(name=f"{names}:assembler", **actor_options(placement.actor("assembler"), groups)),
                          consumer="assembler-0")
    except BaseException:
        remove_groups(groups)
        raise
    return learner, generators, scorers, assembler, placement, groups


def create_learner(cfg: RunConfig, ctx: RunContext, model_path: str, total_steps: int, names: str,
                   rank_options: list[dict] | None = None, timeout_s: float | None = None):
    """The learner's `cfg.learner.num_ranks` rank actors (`<names>:learner-<r>`), handed to a LearnerGroup
    that joins them into one world. `rank_options[r]`: rank r's Ray `.options()` from its placement slot
    (num_gpus, num_cpus, scheduling_strategy); None: num_cpus=cfg.learner.num_cpus each, no GPU."""
    from actors.learner import shell as learner_module
    from actors.learner.group import JOIN_TIMEOUT_S, LearnerGroup

    n = int(cfg.learner.num_ranks)
    if n < 1:
        raise ValueError(f"learner.num_ranks must be >= 1, got {n}")
    if rank_options is not None and len(rank_options) != n:
        raise ValueError(f"learner.num_ranks={n} but the placement gives {len(rank_options)} learner ranks")
    ranks = []
    for r in range(n):
        opts: dict[str, Any] = dict(name=f"{names}:learner-{r}", num_cpus=cfg.learner.num_cpus, num_gpus=0)
        opts.update(rank_options[r] if rank_options is not None else {})
        ranks.append(spawn(learner_module.LearnerShell, cfg.learner, ctx, options=opts, model_cfg=cfg.model,
                           model_path=model_path, total_steps=total_steps,
                           micro_batch_tokens=cfg.assembler.micro_batch_tokens,
                           temperature=cfg.generator.temperature, rank=r, world_size=n))
    try:
        return LearnerGroup.joined(ranks, cfg.learner.zero_stage, JOIN_TIMEOUT_S if timeout_s is None else timeout_s,
                                   call_timeout_s=cfg.coordinator.call_timeout_s,
                                   train_timeout_s=cfg.coordinator.step_timeout_s)
    except BaseException:
        LearnerGroup(ranks).kill()
        raise


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
        wait_built({**{f"generator-{i}": g for i, g in enumerate(generators)},
                    **{f"scorer-{i}": s for i, s in enumerate(scorers)}, "assembler": assembler,
                    **{f"learner rank {r}": h for r, h in enumerate(learner.ranks)}})
        loops += [a.run.remote() for a in [*generators, *scorers]]
        get_within(assembler.start.remote(), cfg.coordinator.call_timeout_s, "assembler.start")
        asyncio.run(learner.connect())  # the group bounds its ranks' calls
        if placement.gpu_shared:  # the learner trains (warm start) only once every engine's start-up profile is done
            from launch.startup_memory import STARTUP_TIMEOUT_S

            get_within([g.pid.remote() for g in generators], STARTUP_TIMEOUT_S, "generators.pid (engine start-up)")
        memory = memory or StartupMemory(log, False)
        memory.mark("engines built", learner, generators)
        coordinator = spawn(Coordinator, cfg, ctx,
                            options=dict(name=f"{names}:coordinator", **actor_options(placement.actor("coordinator"), groups)),
                            train_items=train_items, eval_items=eval_items, generators=generators, learner=learner,
                            assembler=assembler)
        wait_built({"coordinator": coordinator})
        return _drive_coordinator(cfg, Path(ctx.run_dir), model_path, train_items, log, learner, generators,
                                  coordinator, loops, memory, draws)
    finally:
        stop_actors(names, generators, scorers, assembler, learner, coordinator, loops, log)


def _drive_coordinator(cfg: RunConfig, run_dir: Path, model_path: str, train_items: list, log, learner,
                       generators: list, coordinator, loops: list, memory: StartupMemory | None = None,
                       draws=None) -> dict[str, Any]:
    """Warm start (or resume), the initial sync, then the coordinator's loop to its end, watching the
    stream loops (one that ends on its own is an error) and the coordinator's liveness (watch_coordinator).
    `memory` marks the start-up phases. Every wait is bounded: the coordinator and the learner group bound
    their own calls, the rest here."""
    import asyncio

    from actors.coordinator.bounds import call_bound
    from actors.coordinator.coordinator import Coordinator
    from launch.progress import Progress

    memory = memory or StartupMemory(log, False)
    bound = cfg.coordinator.call_timeout_s
    get_within(coordinator.attach_metrics.remote(), bound, "coordinator.attach_metrics")
    latest = Coordinator.latest_checkpoint(run_dir) if cfg.coordinator.resume else None
    if latest is not None:
        log.info("resuming", checkpoint=str(latest))
        watch_coordinator(coordinator, coordinator.resume_from.remote(latest), bound, loops)
    else:
        if cfg.coordinator.mode == "colocated" and will_warm_start(cfg):
            # The warm start trains with the engines asleep (weights and KV released), never beside a
            # resident engine: the device's start-up peak stays that of a training step, not both at once.
            async def sleep_all():
                await asyncio.gather(*(call_within(call_bound(cfg, "generator", "sleep"), f"generator-{i}", g, "sleep",
                                                   cfg.generator.sleep_level) for i, g in enumerate(generators)))
            asyncio.run(sleep_all())
            memory.mark("engines asleep", learner, generators)
        sft = warm_start(cfg, learner, train_items, model_path, log, draws=draws)
        if sft:
            memory.mark("warm start done", learner, generators)
        watch_coordinator(coordinator, coordinator.initial_sync.remote(sft), bound, loops)
        memory.mark("initial sync done", learner, generators)
    metrics = layout.metrics_file(run_dir)  # a resumed run prints only its own rows
    progress = Progress(run_dir, cfg.coordinator.steps,
                        seen=len(metrics.read_text().splitlines()) if cfg.coordinator.resume and metrics.exists() else 0)
    summary = watch_coordinator(coordinator, coordinator.run.remote(), bound, loops, on_tick=progress.print_new)
    progress.print_new()
    return summary


def wait_built(actors: dict[str, Any], timeout_s: float | None = None) -> None:
    """Waits until every actor (label -> handle) is built (its constructor returned: a model loaded, an
    engine up), at most `timeout_s` (the learner group's JOIN_TIMEOUT_S: a 32B load); a constructor's
    error is raised as is, an actor still unbuilt after the bound is ActorCallTimeout naming it. Calls
    bounded by coordinator.call_timeout_s come after this: their bound never has to cover a build."""
    import ray

    from actors.learner.group import JOIN_TIMEOUT_S

    timeout_s = JOIN_TIMEOUT_S if timeout_s is None else timeout_s
    refs = {label: handle.__ray_ready__.remote() for label, handle in actors.items()}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ray.get(ready)
    if pending:
        unbuilt = [label for label, ref in refs.items() if ref in set(pending)]
        raise ActorCallTimeout(f"{', '.join(unbuilt)}: not built within {timeout_s:g} s (a constructor that hangs, "
                               f"or an actor Ray cannot schedule)")


# The launcher asks the coordinator for its pid this often while a long call of it runs.
PING_EVERY_S = 10.0


def watch_coordinator(coordinator, ref, ping_timeout_s: float, loops: list, on_tick=None,
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
            ping = (coordinator.pid.remote(), now)
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
    `timeout_s`: what is left is in Redis for a resumed run), the engines close (vLLM's engine core
    exits with its own shutdown), then every actor of the run is killed with no_restart and none is
    left alive. Removing a placement group under live restartable actors instead restarts them and
    fails their running tasks ("Task ... failed ... The actor was restarted" from the raylet) and can
    leave them pending in a cluster the run joined. Never raises (teardown goes on); logs one line."""
    import ray

    t0 = time.monotonic()
    consumers = [a for a in [*generators, *scorers, assembler] if a is not None]
    out: dict[str, Any] = {"loops": len(loops)}
    try:
        stops = [a.stop.remote() for a in consumers]
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        done, _ = ray.wait(loops, num_returns=len(loops), timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
        out["loops_drained"] = len(done)
        closes = [g.close.remote() for g in generators] + [s.close.remote() for s in scorers]
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


# ---------------------------------------------------------------------------------------------
# Placement groups: what config.placement.make_placement says, built in Ray (the launcher and --preflight)


class PlacementFailed(RuntimeError):
    """One line naming the plan node (and the Ray node, when one died) that cannot be placed."""


def _cluster_nodes_line() -> str:
    import ray

    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n for n in nodes if not n.get("Alive")]
    line = f"{len(alive)} alive Ray node(s)"
    if dead:
        line += "; dead: " + ", ".join(f"{n.get('NodeManagerAddress', '?')} (node id {n['NodeID'][:8]})" for n in dead)
    return line


def build_placement_groups(placement, timeout_s: float = 120.0, name: str = "arl") -> list:
    """One STRICT_PACK placement group per plan node (none for a CPU recipe), ready within `timeout_s`
    (together), or PlacementFailed naming the first plan node whose bundles cannot be placed; the
    groups already made are removed then."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if not placement.gpu:
        return []
    groups = [placement_group(row, strategy="STRICT_PACK", name=f"{name}:node{i}")
              for i, row in enumerate(placement.bundles)]
    refs = [g.ready() for g in groups]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        node = next(i for i, r in enumerate(refs) if r not in ready)
        for g in groups:
            remove_placement_group(g)
        from launch.plan import _bundle_list

        raise PlacementFailed(f"plan node {node}: its placement group ({_bundle_list(placement.bundles[node])}, "
                              f"STRICT_PACK) cannot be placed within {timeout_s:g} s; {_cluster_nodes_line()}")
    return groups


def check_cpus(placement) -> None:
    """CPU recipes: the actors' CPU requests must fit the Ray cluster's CPUs, or an actor would wait forever."""
    import ray

    if placement.gpu:
        return  # the placement groups' bounded wait covers GPU recipes
    have = float(ray.cluster_resources().get("CPU", 0.0))
    want = sum(a.num_cpus for a in placement.actors)
    if want > have + 1e-9:
        raise PlacementFailed(f"the actors ask for {want:g} CPUs but the Ray cluster has {have:g} ("
                              + ", ".join(f"{a.name}={a.num_cpus:g}" for a in placement.actors)
                              + "): lower their num_cpus or raise cluster.num_cpus")


def group_nodes(groups: list) -> list[str]:
    """The Ray node id each plan node's group landed on."""
    from ray.util.placement_group import placement_group_table

    return [placement_group_table(g)["bundles_to_node_id"][0] for g in groups]


def bundle_gpu_ids(placement, groups: list, timeout_s: float = 60.0) -> dict[tuple[int, int], list[int]]:
    """(plan node, bundle) -> the node-local GPU ids Ray gave that bundle, by a tiny task in each."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from launch.probe import bundle_gpu_ids as probe

    task = ray.remote(max_calls=0)(probe)  # (GPU tasks default to one call per worker process)
    keys = [(n, b) for n, row in enumerate(placement.bundles) for b, res in enumerate(row) if res.get("GPU")]
    refs = [task.options(num_cpus=0, num_gpus=0.001,
                         scheduling_strategy=PlacementGroupSchedulingStrategy(groups[n], b)).remote()
            for n, b in keys]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        missing = [keys[i] for i, r in enumerate(refs) if r not in set(ready)]
        raise PlacementFailed(f"GPU id probes of {len(missing)} bundle(s) (first: plan node {missing[0][0]} bundle "
                              f"{missing[0][1]}) did not answer within {timeout_s:g} s; {_cluster_nodes_line()}")
    return dict(zip(keys, ray.get(refs)))


def device_ids(slot, gpu_ids: dict[tuple[int, int], list[int]]) -> list[int] | None:
    """An engine's node-local GPU ids: its TP bundles' (None on CPU)."""
    if not slot.gpus:
        return None
    return [i for g in slot.gpus for i in gpu_ids[(slot.node, g)]]


def actor_options(slot, groups: list) -> dict[str, Any]:
    """The Ray .options() of the actor at `slot`: its resources and, on GPU recipes, its bundle."""
    opts: dict[str, Any] = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus}
    if groups and slot.bundle is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            groups[slot.node], placement_group_bundle_index=slot.bundle, placement_group_capture_child_tasks=False)
    return opts


def remove_groups(groups: list) -> None:
    from ray.util.placement_group import remove_placement_group

    for g in groups:
        try:
            remove_placement_group(g)
        except Exception:  # noqa: BLE001 - teardown goes on
            pass
