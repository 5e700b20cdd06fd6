"""Creates the actors of one run: the learner's ranks, the generators, the scorers and the assembler,
each on its slot of the placement, and waits until they are built.

Construction: every actor is built one way (actors/shell.py `spawn`): its config section, the run's
one config.context.RunContext (run id, run dir, Redis URL, logging, stream settings; launch/run.py
makes it) and its specifics -- here and nowhere else (the learner's ranks too: create_learner; the
coordinator, which needs the others' handles, by launch/place.py the same way).

Placement: every actor is created with the Ray options of its slot in config.placement.make_placement(cfg)
(launch/groups.py `actor_options`), the function --dry-run renders and --preflight builds; the groups
are made here and handed back to the caller, which removes them (or removed here when creation fails).

Start-up order: where a learner rank shares its GPU with an engine (colocated, or async on shared GPUs),
the learner is built and asleep before any engine is created (create_actors), each boundary marked with
its device memory (launch/startup_memory.py).

Invariants: nothing created here outlives a failed creation's groups (create_actors removes them and
re-raises; create_learner kills its ranks); waiting for a build is bounded (wait_built: the learner
group's JOIN_TIMEOUT_S, a 32B load), and an actor still unbuilt then is ActorCallTimeout naming it.
"""
from __future__ import annotations

from typing import Any

from actors.shell import ActorCallTimeout, spawn
from config import RunConfig, RunContext
from launch.groups import (
    PlacementFailed,
    actor_options,
    build_placement_groups,
    bundle_gpu_ids,
    check_cpus,
    device_ids,
    remove_groups,
)
from launch.startup_memory import StartupMemory


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

    from actors import assembler as assembler_module
    from actors import scorer as scorer_module
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

