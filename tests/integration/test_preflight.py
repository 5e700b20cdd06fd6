"""--preflight --simulate on real local Ray clusters of the recipes' shapes (ray.cluster_utils.Cluster).

No GPU exists here: the clusters' GPUs are Ray's logical GPUs (ids, no device memory), and the
weight-sync bucket goes by the object store / gloo where the recipe's transport needs CUDA. Everything
else is real: raylets, placement groups, probe actors, the gloo all-reduce, Redis.
"""
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from actors.shell import RESTARTABLE
from config.placement import make_placement
from config.recipes import get_recipe
from launch.preflight import PreflightFailed, run_probes, simulated_cluster
from tests.gpu_standins import GpuStandIn
from tests.standins import LoopingConsumer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster_32b(tmp_path_factory):
    from queues.redis_server import EmbeddedRedis

    cfg = get_recipe("bird_32b")
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as redis, simulated_cluster(make_placement(cfg)) as cluster:
        yield cfg, cluster, redis.url


@pytest.mark.slow
def test_bird_32b_every_actor_where_the_plan_says_logical_gpus(cluster_32b):
    cfg, cluster, url = cluster_32b
    start = time.perf_counter()
    result = run_probes(cfg, url, simulate=True)
    print(f"bird_32b simulated preflight (cluster already up): {time.perf_counter() - start:.1f} s")
    p = result.placement
    assert len(p.actors) == 8 + 32 + 4 and len(set(result.node_ids)) == 4
    for a in p.actors:  # on the Ray node its plan node's placement group landed on
        assert result.reports[a.name]["node_id"] == result.node_ids[a.node], a.name
    holders = defaultdict(list)  # (ray node, gpu id) -> roles
    for a in p.actors:
        r = result.reports[a.name]
        if a.role == "learner":
            assert r["gpu_ids"] == result.bundle_gpus[(a.node, a.gpus[0])] and len(r["gpu_ids"]) == 1
            assert r["cuda_visible_devices"] == str(r["gpu_ids"][0])
        for g in a.gpus:
            for gid in result.bundle_gpus[(a.node, g)]:
                holders[(r["node_id"], gid)].append(a.role)
        assert r["redis"] == "" and r["free_mib"] is None
    for e in p.by_role("generator"):  # each TP-4 engine: 4 distinct GPUs of one node
        ids = [i for g in e.gpus for i in result.bundle_gpus[(e.node, g)]]
        assert len(ids) == 4 and len(set(ids)) == 4
    assert len(holders) == 32  # every GPU of the cluster, each given once except by colocation
    assert all(sorted(roles) == ["generator", "learner"] for roles in holders.values())
    assert result.all_reduce == 32 * 33 / 2
    assert result.weight_sync == "object_store (standing in for cuda_ipc)"
    assert "PREFLIGHT OK" in result.render()


@pytest.mark.slow
def test_bird_1p7b_one_node_eight_tp1_engines_logical_gpus(cluster_32b):
    _, _, url = cluster_32b
    result = run_probes(get_recipe("bird_1p7b"), url, simulate=True)
    p = result.placement
    assert len(set(result.node_ids)) == 1 and result.all_reduce == 36
    for a in p.actors:
        r = result.reports[a.name]
        assert r["node_id"] == result.node_ids[0]
        if a.gpus:  # engine i and learner rank i share bundle i's one GPU
            assert r["gpu_ids"] == result.bundle_gpus[(0, a.bundle)] and a.bundle == a.rank
    assert sorted(i for (_, b), ids in result.bundle_gpus.items() for i in ids) == list(range(8))


def test_launcher_builds_the_plan_s_placement_fake_gpu_actors_stand_in(cluster_32b, monkeypatch, tmp_path):
    import ray

    import actors.assembler
    import actors.generator.shell
    import actors.learner.shell
    import actors.scorer
    from launch.create import create_actors
    from launch.groups import group_nodes, remove_groups
    from launch.plan import make_plan

    for module, name in ((actors.generator.shell, "GeneratorShell"), (actors.learner.shell, "LearnerShell"),
                         (actors.scorer, "ScorerShell"), (actors.assembler, "Assembler")):
        monkeypatch.setattr(module, name, GpuStandIn)  # the launcher builds each with actors.shell.spawn
    from config import RunContext, apply_overrides

    cfg = apply_overrides(get_recipe("bird_1p7b"), [])  # validated: learner.num_ranks is the placement's
    plan = make_plan(cfg)  # what --dry-run prints
    learner, generators, scorers, assembler, placement, groups = create_actors(
        cfg, RunContext(run_id="launch-test", run_dir=str(tmp_path)), "/no/model", 1, names="launch-test")
    try:
        assert placement.to_dict() == plan.placement.to_dict()
        node = group_nodes(groups)[0]
        handles = dict(zip([f"learner-{i}" for i in range(8)], learner.ranks))
        handles.update({f"generator-{i}": g for i, g in enumerate(generators)})
        handles.update({f"scorer-{i}": s for i, s in enumerate(scorers)}, assembler=assembler)
        names = list(handles)
        reports = dict(zip(names, ray.get([handles[n].report.remote() for n in names], timeout=120)))
        assert all(r["node_id"] == node for r in reports.values())
        for row in plan.placements:  # every planned row's GPUs are the GPUs its actors hold
            if row.actor.startswith("generator-"):
                assert reports[row.actor]["gpu_ids"] == row.gpus
                assert ray.get(handles[row.actor].got_device_ids.remote()) == row.gpus
        assert [reports[f"learner-{i}"]["gpu_ids"] for i in range(8)] == [[i] for i in range(8)]
        assert learner.world_size == plan.learner_world_size == 8
    finally:
        remove_groups(groups)


class _Looping(GpuStandIn, LoopingConsumer):
    """A stand-in with a consumer's loop (run until stop) and close: the generator's and scorer's shape."""


class _LoopingStage(_Looping):
    """The generators', scorers' and assembler's stand-in: restartable by Ray, as their classes are."""

    RAY_OPTIONS = dict(RESTARTABLE)


def _place_looping(monkeypatch, tmp_path, name: str):
    import ray

    import actors.assembler
    import actors.generator.shell
    import actors.learner.shell
    import actors.scorer
    from launch.create import create_actors

    for module, attr, cls in ((actors.generator.shell, "GeneratorShell", _LoopingStage),
                              (actors.learner.shell, "LearnerShell", _Looping), (actors.scorer, "ScorerShell", _LoopingStage),
                              (actors.assembler, "Assembler", _LoopingStage)):
        monkeypatch.setattr(module, attr, cls)  # the launcher builds each with actors.shell.spawn
    from config import RunContext, apply_overrides

    learner, generators, scorers, assembler, _, groups = create_actors(
        apply_overrides(get_recipe("gpu1_0p6b"), []), RunContext(run_id=name, run_dir=str(tmp_path)), "/no/model", 1,
        names=name)
    loops = [a.run.remote() for a in [*generators, *scorers]]
    ray.get([a.report.remote() for a in [*generators, *scorers, assembler, *learner.ranks]], timeout=120)
    return learner, generators, scorers, assembler, groups, loops


def test_orderly_stop_leaves_no_actor_and_no_raylet_restart_lines_fake_gpu_actors_stand_in(
        cluster_32b, monkeypatch, tmp_path, capfd):
    """The end of a GPU run (launch.place.stop_actors, then the placement groups): the consumers' loops
    return, every actor is killed for good, none is left, and the raylet reports no restart. The old order
    -- removing the placement group under live restartable actors with running loops -- restarts them and
    prints "(raylet) Task ... failed ... The actor was restarted" (the lines every H200 run ended with):
    shown first, so the check below is one that can fail."""
    import structlog

    from launch.groups import remove_groups
    from launch.place import kill_run_actors, stop_actors

    *_, groups, loops = _place_looping(monkeypatch, tmp_path / "old", "old-order")
    remove_groups(groups)
    time.sleep(3)  # the owner hears of the restart within a second or two
    kill_run_actors("old-order")
    old = capfd.readouterr()
    assert "The actor was restarted" in old.out + old.err

    learner, generators, scorers, assembler, groups, loops = _place_looping(monkeypatch, tmp_path / "new", "new-order")
    try:
        out = stop_actors("new-order", generators, scorers, assembler, learner, None, loops, structlog.get_logger())
    finally:
        remove_groups(groups)
    time.sleep(3)
    new = capfd.readouterr()
    assert "(raylet)" not in new.out + new.err, new.out[-2000:]
    assert out["loops_drained"] == out["loops"] == 2 and out["alive"] == 0 and out["killed"] == 4, out


def test_unreachable_redis_names_the_actor_and_node(cluster_32b, tmp_path):
    cfg = get_recipe("tiny")  # 5 CPU probes (no placement group) are enough to see the check
    with pytest.raises(PreflightFailed, match=r"^generator-0 on 127\.0\.0\.1 \(plan node 0\): Redis does not answer") as e:
        run_probes(cfg, f"unix://{tmp_path}/no-redis.sock", simulate=True, timeout_s=60)
    assert str(e.value).endswith("give every node REDIS_URL=redis://host:port)") and "\n" not in str(e.value)


def test_a_dead_node_fails_preflight_in_one_line_naming_it(cluster_32b):
    cfg, cluster, url = cluster_32b
    # runs last on the shared cluster (pytest keeps file order); earlier runs removed their probes and groups
    dead = next(iter(cluster.worker_nodes))
    cluster.remove_node(dead)
    start = time.perf_counter()
    with pytest.raises(PreflightFailed) as e:
        run_probes(cfg, url, simulate=True, placement_timeout_s=8)
    msg = str(e.value)
    assert "\n" not in msg and "cannot be placed within 8 s" in msg, msg
    assert f"dead: 127.0.0.1 (node id {dead.node_id[:8]})" in msg, msg
    assert time.perf_counter() - start < 30


def test_cli_simulate_without_preflight_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", "--simulate"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --simulate goes with --preflight"

