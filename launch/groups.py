"""Ray placement groups: what config.placement.make_placement(cfg) says, built in Ray, and each actor's
Ray options from its slot in it (the launcher, launch/create.py, and --preflight, launch/preflight.py,
build the same groups the same way).

GPU recipes get one STRICT_PACK placement group per plan node (`build_placement_groups`), ready within
cluster.placement_timeout_s or a one-line PlacementFailed naming the plan node (and any dead Ray node);
a generator gets `device_ids`, the GPU ids Ray gave its TP bundles (`bundle_gpu_ids`: found by a tiny
task in each bundle). CPU recipes use no group; their CPU requests must fit the cluster's CPUs
(`check_cpus`: else PlacementFailed at once, not an actor pending forever, naming the override that
sizes the asks to the cluster: cluster.num_cpus, config.placement.fit_cpu_asks).

Invariants: every wait here is bounded by the `timeout_s` it is given; a failure to place is one line,
PlacementFailed, and leaves no group behind (the groups already made are removed); `actor_options` is
the one place a slot becomes Ray `.options()`, so the launcher's actors and preflight's probes land on
the same bundles; `remove_groups` never raises (teardown goes on).
"""
from __future__ import annotations

from typing import Any

from launch.plan_table import bundle_list


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
        raise PlacementFailed(f"plan node {node}: its placement group ({bundle_list(placement.bundles[node])}, "
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
                              + f"): run with cluster.num_cpus={max(1, int(have))} to size the asks to it")


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
