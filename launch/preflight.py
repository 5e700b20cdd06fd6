"""`python -m launch.cluster RECIPE --preflight [--simulate]`: build the placement, load no model.

What it does, in order (each step bounded; the first failure is one line, PreflightFailed):
1. config.placement.make_placement(cfg) -- the function --dry-run renders; its errors fail at once.
2. One STRICT_PACK placement group per plan node (launch.groups.build_placement_groups), the GPU ids
   of every bundle by a tiny task in it, then one light probe actor (launch.probe.Probe) per planned
   actor with exactly the options the launcher gives the real one (launch.groups.actor_options).
3. Every probe reports its Ray node, GPU ids (ray.get_gpu_ids(), CUDA_VISIBLE_DEVICES), free device
   memory (nvidia-smi, where a GPU exists), whether Redis answers PING from there and, on a real
   cluster, whether model.path (learner ranks, engines) and data.bird_dir (coordinator, scorers)
   are readable there. Checked against the plan: each actor on its plan node's Ray node and on its
   bundle's GPU, each engine's TP bundles on distinct GPUs of one node, no GPU held by two actors
   except a colocated learner rank and the engine covering it.
4. An all-reduce of (rank + 1) over the learner-rank probes (gloo on CPU and simulated, NCCL on
   GPUs; the store on rank 0's node address): the sum must be W(W+1)/2.
5. One bucket through the real weight sync of the transport the placement implies: its
   ``Transport.sync`` from the learner-rank probes (fanned out and merged as the learner group does)
   to every engine probe, each probe holding the real ends (weights.endpoint); simulated GPUs have no
   CUDA: cuda_ipc runs as object_store, nccl's group as gloo.
6. One table, exit 0. Probes and groups are removed at the end, success or not.

`--simulate` starts a local ray.cluster_utils.Cluster of the recipe's shape (num_nodes raylets, each
with gpus_per_node logical GPUs and the CPUs its bundles need, own temp dir, loopback) and runs the
same steps there; GPU ids are logical and there is no device memory; model and BIRD paths are not
checked. Ray's Cluster writes its address to Ray's default address file (/tmp/ray/ray_current_cluster) even
with a temp dir of its own: the simulation makes that directory where it is missing (a fresh machine) and puts
the file back as it found it afterwards, so a cluster the user runs is still the one a bare `ray.init()` finds.
Redis: REDIS_URL / cluster.redis_url, else an embedded redis-server started for the check.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config import RunConfig
from config.placement import Placement, make_placement

LOOPBACK = "127.0.0.1"
# Each wait on the probes (reports, rendezvous, collectives): generous, because a simulated bird_32b
# starts 44 probe processes and imports torch in 40 of them on one (possibly shared) 2-core machine.
PROBE_TIMEOUT_S = 300.0
# A simulated node has as many logical CPUs as its bundles need; Ray would start that many idle workers.
NO_PRESTART = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0"}


class PreflightFailed(RuntimeError):
    """The first failure, one line."""


@dataclass
class PreflightResult:
    placement: Placement
    reports: dict[str, dict]  # actor name -> what its probe reported (+ "plan_node", "bundle")
    node_ids: list[str]  # plan node -> Ray node id
    bundle_gpus: dict[tuple[int, int], list[int]]
    all_reduce: float = 0.0
    weight_sync: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def render(self) -> str:
        p = self.placement
        lines = [f"preflight: {len(p.actors)} actors on {p.num_nodes} node(s), learner world size "
                 f"{p.learner_world_size}", "",
                 f"  {'actor':<14} {'node':>4} {'ray node':<10} {'ip':<15} {'bundle':>6} {'gpu ids':<9} "
                 f"{'CUDA_VISIBLE':<12} {'free MiB':<9} redis"]
        for a in p.actors:
            r = self.reports[a.name]
            free = ",".join(map(str, r["free_mib"])) if r["free_mib"] else "-"
            bundle = "-" if a.bundle is None else ("cpu" if a.bundle == p.cpu_bundle else str(a.bundle))
            lines.append(f"  {a.name:<14} {a.node:>4} {r['node_id'][:8]:<10} {r['ip']:<15} {bundle:>6} "
                         f"{','.join(map(str, r['gpu_ids'])) or '-':<9} {r['cuda_visible_devices'] or '-':<12} "
                         f"{free:<9} {'ok' if not r['redis'] else 'FAIL'}")
        w = p.learner_world_size
        lines += ["", f"all-reduce over {w} learner rank(s): {self.all_reduce:g} (expected {w * (w + 1) / 2:g})",
                  f"weight sync: one bucket by {self.weight_sync} to {len(p.by_role('generator'))} engine(s): ok",
                  "timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()), "", "PREFLIGHT OK"]
        return "\n".join(lines)


def _get(refs: list, timeout_s: float, what: str, names: list[str]) -> list:
    """ray.get with a bound; a timeout or a dead actor is one line naming the first actor concerned."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        late = [n for n, r in zip(names, refs) if r not in ready]
        raise PreflightFailed(f"{what}: {len(late)} of {len(refs)} did not answer within {timeout_s:g} s "
                              f"(first: {late[0]})")
    out = []
    for name, ref in zip(names, refs):
        try:
            out.append(ray.get(ref, timeout=1.0))
        except (RayActorError, GetTimeoutError) as e:
            raise PreflightFailed(f"{what}: {name} died ({type(e).__name__})") from None
        except Exception as e:  # noqa: BLE001 - the probe's own error, one line
            from launch.run import one_line

            raise PreflightFailed(f"{what}: {name}: {one_line(e)}") from None
    return out


def check_reports(placement: Placement, reports: dict[str, dict], node_ids: list[str],
                  bundle_gpus: dict[tuple[int, int], list[int]], simulate: bool) -> None:
    """Every actor where the plan says (see the module docstring, step 3); PreflightFailed otherwise."""
    held: dict[tuple[str, int], list[str]] = {}
    for a in placement.actors:
        r = reports[a.name]
        if node_ids and r["node_id"] != node_ids[a.node]:
            raise PreflightFailed(f"{a.name}: on Ray node {r['node_id'][:8]}, but plan node {a.node} is "
                                  f"{node_ids[a.node][:8]}")
        if a.gpus:
            expected = bundle_gpus[(a.node, a.bundle)]
            if r["gpu_ids"] != expected:
                raise PreflightFailed(f"{a.name}: Ray gives it GPU {r['gpu_ids']}, its bundle {a.bundle} holds {expected}")
            for g in a.gpus:
                for gid in bundle_gpus[(a.node, g)]:
                    held.setdefault((r["node_id"], gid), []).append(a.role)
        if r["redis"]:
            raise PreflightFailed(f"{a.name} on {r['ip']} (plan node {a.node}): Redis does not answer: {r['redis']}")
        if r["unreadable"]:
            raise PreflightFailed(f"{a.name} on {r['ip']} (plan node {a.node}): cannot read {r['unreadable'][0]}")
    for e in placement.by_role("generator"):
        ids = [i for g in e.gpus for i in bundle_gpus[(e.node, g)]]
        if len(set(ids)) != len(e.gpus):
            raise PreflightFailed(f"{e.name}: its {len(e.gpus)} TP bundles hold GPUs {ids}, not {len(e.gpus)} distinct ones")
    for (node, gid), roles in held.items():
        if sorted(roles) not in (["learner"], ["generator"], ["generator", "learner"]):
            raise PreflightFailed(f"GPU {gid} of Ray node {node[:8]} is given to {sorted(roles)}")


def _paths(cfg: RunConfig, role: str, simulate: bool) -> list[str]:
    if simulate:
        return []
    if role in ("learner", "generator") and cfg.model.source != "tiny" and os.path.isabs(cfg.model.path):
        return [cfg.model.path]
    if role in ("coordinator", "scorer") and cfg.data.bird_dir and not cfg.data.synthetic:
        return [cfg.data.bird_dir]
    return []


def run_probes(cfg: RunConfig, redis_url: str, simulate: bool, placement_timeout_s: float = 120.0,
               timeout_s: float = PROBE_TIMEOUT_S, names: str = "preflight") -> PreflightResult:
    """Steps 1-5 on the Ray cluster this process is connected to."""
    import ray

    from launch.groups import (
        PlacementFailed,
        actor_options,
        build_placement_groups,
        bundle_gpu_ids,
        check_cpus,
        group_nodes,
        remove_groups,
    )
    from launch.probe import Probe

    t0 = time.perf_counter()
    placement = make_placement(cfg)
    if placement.errors:
        raise PreflightFailed(placement.errors[0])
    try:
        check_cpus(placement)
        groups = build_placement_groups(placement, placement_timeout_s, name=names)
    except PlacementFailed as e:
        raise PreflightFailed(str(e)) from None
    probes: dict[str, Any] = {}
    try:
        node_ids = group_nodes(groups) if groups else []
        bundle_gpus = bundle_gpu_ids(placement, groups, timeout_s) if groups else {}
        timings = {"placement groups": time.perf_counter() - t0}
        from actors.shell import ray_actor

        actor_cls = ray_actor(Probe)
        for a in placement.actors:
            probes[a.name] = actor_cls.options(**actor_options(a, groups)).remote(a.name)
        names_ = [a.name for a in placement.actors]
        got = _get([probes[a.name].report.remote(redis_url, _paths(cfg, a.role, simulate)) for a in placement.actors],
                   timeout_s, "probe report", names_)
        reports = dict(zip(names_, got))
        timings["probes placed"] = time.perf_counter() - t0 - timings["placement groups"]
        check_reports(placement, reports, node_ids, bundle_gpus, simulate)
        result = PreflightResult(placement, reports, node_ids, bundle_gpus, timings=timings)
        t1 = time.perf_counter()
        result.all_reduce = _all_reduce(placement, probes, simulate, timeout_s)
        timings["all-reduce"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        result.weight_sync = _weight_sync(placement, probes, simulate, timeout_s)
        timings["weight sync"] = time.perf_counter() - t1
        timings["total"] = time.perf_counter() - t0
        return result
    finally:
        for handle in probes.values():
            ray.kill(handle, no_restart=True)
        remove_groups(groups)


def _all_reduce(placement: Placement, probes: dict, simulate: bool, timeout_s: float) -> float:
    ranks = placement.by_role("learner")
    world = len(ranks)
    backend = "nccl" if placement.gpu and not simulate else "gloo"
    r0 = probes[ranks[0].name]
    host, port = _get([r0.store_listen.remote(world, timeout_s)], timeout_s, "all-reduce rendezvous", [ranks[0].name])[0]
    sums = _get([probes[a.name].all_reduce.remote(host, port, a.rank, world, backend, timeout_s) for a in ranks],
                timeout_s + 15, f"{backend} all-reduce over {world} learner ranks", [a.name for a in ranks])
    expected = world * (world + 1) / 2
    bad = [(a.name, s) for a, s in zip(ranks, sums) if s != expected]
    if bad:
        raise PreflightFailed(f"{backend} all-reduce over {world} learner ranks: {bad[0][0]} got {bad[0][1]:g}, "
                              f"expected {expected:g}")
    return expected


def _weight_sync(placement: Placement, probes: dict, simulate: bool, timeout_s: float) -> str:
    """One bucket through the real sync (``Transport.sync`` of the placement's transport, as simulated
    where no GPU exists) from the learner-rank probes to every engine probe; returns its name."""
    from weights import Link
    from weights.strategy import get_transport

    engines = placement.by_role("generator")
    if not engines:
        return "none (no engines)"
    kind, cuda = placement.weight_sync, placement.gpu and not simulate
    if not cuda and kind == "cuda_ipc":
        kind = "object_store"
    shown = "gloo" if kind == "nccl" and not cuda else kind  # nccl's group on CPU devices is gloo
    transport = get_transport(kind)
    ranks = placement.by_role("learner")
    what = f"weight sync ({shown})"
    names = [a.name for a in ranks] + [e.name for e in engines]
    _get([probes[a.name].weight_ends.remote(a.rank, "cuda" if cuda else "cpu", timeout_s) for a in ranks] +
         [probes[e.name].weight_ends.remote(0, "cpu", timeout_s) for e in engines], timeout_s, what, names)

    async def learner_group(call):  # actors/learner/group.py's send_weights: the ranks the transport names
        plan = transport.fan_out(call, len(ranks), 0)
        return transport.merge(call, await asyncio.gather(*(probes[ranks[r].name].send_weights.remote(c)
                                                            for r, c in plan)))

    link = Link(learner_group, [probes[e.name].receive_weights.remote for e in engines])
    try:
        asyncio.run(asyncio.wait_for(transport.sync(link, 1, 1), timeout_s + 15))
    except Exception as e:  # noqa: BLE001 - the first failure, one line
        from launch.run import one_line

        raise PreflightFailed(f"{what}: {one_line(e)}") from None
    names = [e.name for e in engines]
    bad = [(n, c) for n, c in zip(names, _get([probes[n].ws_check.remote() for n in names], timeout_s, what, names)) if c]
    if bad:
        raise PreflightFailed(f"{what}: {bad[0][0]}: {bad[0][1]}")
    return shown if shown == placement.weight_sync else f"{shown} (standing in for {placement.weight_sync})"


@contextlib.contextmanager
def simulated_cluster(placement: Placement, temp_root: str | None = None):
    """A local Ray cluster of the placement's shape; yields the Cluster (connected), removes it after."""
    import ray
    from ray.cluster_utils import Cluster

    from launch.local_ray import environ, ray_on_loopback, run_env

    cpus = max(sum(b.get("CPU", 0.0) for b in row) for row in placement.bundles) if placement.gpu else \
        sum(a.num_cpus for a in placement.actors)
    cpus = math.ceil(cpus) + 1
    gpus = placement.gpus_per_node
    temp_dir = tempfile.mkdtemp(prefix="arl-preflight-", dir=temp_root or "/tmp")
    address_file = _ray_address_file()
    previous_address = address_file.read_bytes() if address_file.is_file() else None
    address_file.parent.mkdir(parents=True, exist_ok=True)
    cluster = None
    env = environ(NO_PRESTART)  # the raylets inherit it: no idle workers per logical CPU
    env.__enter__()
    try:
        with ray_on_loopback(True):  # the raylets and the driver on 127.0.0.1 (else it dials the host's address)
            cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=cpus, num_gpus=gpus, temp_dir=temp_dir, include_dashboard=False, node_ip_address=LOOPBACK))
            for _ in range(placement.num_nodes - 1):
                cluster.add_node(num_cpus=cpus, num_gpus=gpus, node_ip_address=LOOPBACK)
            cluster.wait_for_nodes(timeout=120)
            ray.init(address=cluster.address, runtime_env={"env_vars": run_env()}, log_to_driver=False)
        yield cluster
    finally:
        env.__exit__(None, None, None)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        _restore(address_file, previous_address)


def _ray_address_file() -> Path:
    """Where Ray's Cluster records the newest cluster's address (its temp_dir argument does not move it)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def _restore(path: Path, content: bytes | None) -> None:
    """`path` as it was: `content`, or no file where there was none."""
    try:
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content)
    except OSError:
        pass  # another user's /tmp/ray: theirs to keep


def preflight(cfg: RunConfig, simulate: bool = False, placement_timeout_s: float = 120.0,
              timeout_s: float = PROBE_TIMEOUT_S) -> PreflightResult:
    """The whole check: Redis (REDIS_URL or an embedded one), Ray (simulated or the configured one), steps 1-5."""
    import ray

    from launch.local_ray import start_ray
    from launch.run import preflight as reachable
    from launch.run import redis_url_of

    placement = make_placement(cfg)
    if placement.errors:
        raise PreflightFailed(placement.errors[0])
    reachable(cfg)  # an external Redis / RAY_ADDRESS that does not answer: one line, at once
    with tempfile.TemporaryDirectory(prefix="arl-preflight-redis-") as scratch:
        url, server = redis_url_of(cfg), None
        if not url:
            from queues.redis_server import EmbeddedRedis

            server = EmbeddedRedis(Path(scratch)).start()
            url = server.url
        try:
            if simulate:
                with simulated_cluster(placement):
                    return run_probes(cfg, url, True, placement_timeout_s, timeout_s)
            start_ray(cfg, Path(scratch), None)
            try:
                return run_probes(cfg, url, False, placement_timeout_s, timeout_s)
            finally:
                ray.shutdown()
        finally:
            if server is not None:
                server.stop()
