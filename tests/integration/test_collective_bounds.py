"""Every collective is bounded (learner.collective_timeout_s): a peer that dies (SIGKILL) or hangs
(SIGSTOP) in the middle of a collective fails it on the survivors within the bound, never a hang.

Real processes over gloo: the learner's world as actors/learner/world.py builds it, with a group made
the way DeepSpeed makes its data-parallel groups (deepspeed.comm.new_group, no timeout argument); the
weight-sync group of weights/broadcast.py. The hang guard of each test is a few times the bound: a
collective left on torch's defaults (30 min) fails the test instead of passing late.
"""
from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import threading
import time

import pytest

from tests.procs import fresh_processes

BOUND_S = 4.0  # the collective timeout of the process-level tests
GUARD_S = 4 * BOUND_S + 60  # a fork server's first start (imports of torch / deepspeed) on a busy 2-core machine


def _rank_main(rank: int, ports, joins, results) -> None:
    """One rank: joins the world (rank 0 binds the store), warms up one all-reduce on the world group
    and on a DeepSpeed group, then rank 1 stops taking part and rank 0 all-reduces on each group.
    `joins` (a barrier) starts each join on both ranks together: imports on a loaded machine take
    longer than the bound."""
    try:
        import deepspeed
        import deepspeed.comm
        import torch
        import torch.distributed as dist

        from actors.learner.engine import _skip_cpu_shm_comm_build
        from actors.learner.world import is_collective_failure
        from bench.faults.collective_bound import join_pair

        _skip_cpu_shm_comm_build()  # as the learner does (a JIT build of an op it never uses)
        join_pair(rank, "gloo", BOUND_S, ports, joins, GUARD_S)
        deepspeed.init_distributed("gloo")  # wraps the world above, as deepspeed.initialize does
        joins.wait(GUARD_S)
        groups = {"world": dist.group.WORLD, "deepspeed": deepspeed.comm.new_group([0, 1])}
        x = torch.ones(1 << 16)
        for group in groups.values():
            dist.all_reduce(x, group=group)
        results.put(("ready", rank, os.getpid()))
        if rank == 1:
            time.sleep(3600)  # killed or stopped by the test: it never enters the next collective
        out = {}
        for name, group in groups.items():
            t0 = time.monotonic()
            try:
                dist.all_reduce(x, group=group)
                out[name] = ("returned", False, "", 0.0)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[name] = (type(exc).__name__, is_collective_failure(exc), str(exc).splitlines()[0][:300],
                             time.monotonic() - t0)
        results.put(("survivor", rank, out))
    except BaseException as exc:  # noqa: BLE001
        results.put(("crash", rank, repr(exc)[:500]))


@pytest.mark.slow  # two ranks joining gloo and DeepSpeed worlds: ~10-20 s each on 2 busy cores
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_rank_lost_mid_all_reduce_fails_the_survivors_collectives_within_the_bound(sig):
    """Rank 1 of 2 is SIGKILLed (its sockets close) or SIGSTOPped (alive, silent: a stuck GPU, a lost
    node) while rank 0 all-reduces, on the world group and on a DeepSpeed-made group: rank 0's
    collectives fail, each as a collective failure (what the launcher relaunches on), a hung peer by
    the group's own timeout, which is the bound we set, not torch's 30 min default."""
    ctx = fresh_processes(__name__)
    # A queue per rank: a process stopped while its queue's feeder thread holds the queue's lock would
    # block the survivor's report on it.
    ports, joins, results = ctx.Queue(), ctx.Barrier(2), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_rank_main, args=(rank, ports, joins, results[rank]), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        pids = {}
        for q in results:
            kind, rank, value = q.get(timeout=GUARD_S)
            assert kind == "ready", (kind, rank, value)
            pids[rank] = value
        os.kill(pids[1], sig)
        try:
            kind, rank, out = results[0].get(timeout=GUARD_S)
        except queue_mod.Empty:
            pytest.fail(f"rank 0's all-reduce still blocked {GUARD_S:.0f} s after rank 1 was lost: a hang")
        assert (kind, rank) == ("survivor", 0), (kind, rank, out)
        print({name: (error, round(s, 1)) for name, (error, _, _, s) in out.items()})
        for name, (error, collective, message, _) in out.items():
            assert error != "returned" and collective, (name, error, message)
            if sig == signal.SIGSTOP:
                assert f"Timed out waiting {int(BOUND_S * 1000)}ms" in message, (name, message)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def test_collective_failures_are_told_from_other_errors():
    from actors.learner.world import is_collective_failure

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7095"
    assert is_collective_failure(RuntimeError(gloo))
    import torch.distributed as dist

    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(ValueError("learner checkpoint x was saved by 2 learner rank(s)"))


# ----------------------------------------------------------------------------- where gloo binds


def test_ranks_on_one_node_bind_loopback_and_ranks_on_several_their_node_address():
    from actors.learner.world import LOOPBACK, interface_of, world_hosts

    assert world_hosts(["10.0.0.5", "10.0.0.5"]) == (LOOPBACK, [LOOPBACK, LOOPBACK])
    assert world_hosts(["10.0.0.5"]) == (LOOPBACK, [LOOPBACK])
    assert world_hosts(["10.0.0.5", "10.0.0.6", "10.0.0.5"]) == ("10.0.0.5", ["10.0.0.5", "10.0.0.6", "10.0.0.5"])
    assert interface_of(LOOPBACK) is not None and interface_of("192.0.2.254") is None  # TEST-NET: nobody's


def _non_loopback_ipv4() -> str | None:
    import socket

    import psutil

    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)


def _bound_rank(rank: int, local_host: str, ports, joins, results) -> None:
    """One rank of a 2-rank gloo world whose gloo binds `local_host`; reports the local addresses of its
    own TCP sockets other than the store's (the gloo pairs' and listener's)."""
    try:
        import psutil
        import torch
        import torch.distributed as dist

        from bench.faults.collective_bound import join_pair

        store_port = join_pair(rank, "gloo", GUARD_S, ports, joins, GUARD_S, local_host=local_host)
        dist.all_reduce(torch.ones(4))
        socks = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.laddr and store_port not in (c.laddr.port, c.raddr.port if c.raddr else None)]
        results.put(("bound", rank, sorted({c.laddr.ip for c in socks}), os.environ.get("GLOO_SOCKET_IFNAME")))
        joins.wait(GUARD_S)  # both reported before either tears the world down
    except BaseException as exc:  # noqa: BLE001
        results.put(("crash", rank, repr(exc)[:500], None))


@pytest.mark.slow  # two processes joining a gloo world (~1 s once the fork server is up)
@pytest.mark.parametrize("where", ["loopback", "node address"])
def test_gloo_binds_the_address_it_is_given_not_what_the_host_name_resolves_to(where):
    """A learner world's gloo sockets sit on loopback (one node) or on the node's address (several
    nodes), whatever the host name resolves to (here: 127.0.0.1, so the node-address case shows gloo no
    longer binds by name)."""
    local_host = "127.0.0.1" if where == "loopback" else _non_loopback_ipv4()
    if local_host is None:
        pytest.skip("this host has no address besides loopback")
    ctx = fresh_processes(__name__)
    ports, joins, results = ctx.Queue(), ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_bound_rank, args=(r, local_host, ports, joins, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=GUARD_S) for _ in procs)
    finally:
        for p in procs:
            p.join(GUARD_S)
            if p.is_alive():
                p.kill()
    from actors.learner.world import interface_of

    for kind, rank, addresses, ifname in got:
        assert kind == "bound", (rank, addresses)
        assert addresses == [local_host] and ifname == interface_of(local_host), (rank, addresses, ifname)


# ----------------------------------------------------------------------------- weight-sync broadcast


def _receiver_stalls_mid_sync(rdv_queue, events) -> None:
    """A generator's receiver that takes the first bucket, then stops taking part (the test kills or
    stops it there, in the middle of the sync)."""
    import asyncio

    import weights as ws

    def load(named, version):
        events.put(("loaded", os.getpid()))
        time.sleep(3600)

    try:
        receiver = ws.BroadcastReceiver(load)
        rdv = rdv_queue.get(timeout=GUARD_S)
        events.put(("up", os.getpid()))  # imports done: the joins that follow are bounded by BOUND_S
        receiver.init(rdv, rank=1)
        asyncio.run(receiver.receive_all(1))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        events.put(("crash", repr(exc)[:500]))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_receiver_lost_mid_broadcast_fails_the_send_within_the_bound(sig):
    """The learner's side of a weight sync whose generator is lost after the first bucket: send()
    raises by itself (nobody closes the group) within its bound, instead of waiting forever."""
    import weights as ws
    from tests.weightsets import BUCKET_MB, make_weights

    ctx = fresh_processes(__name__)
    rdv_queue, events = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_stalls_mid_sync, args=(rdv_queue, events), daemon=True)
    proc.start()
    sender = ws.BroadcastSender(lambda mb: ws.iter_buckets(make_weights(1).items(), mb), BUCKET_MB,
                                backend="gloo", timeout_s=BOUND_S)
    try:
        rdv_queue.put(sender.listen(world_size=2, host="127.0.0.1"))
        outcome: dict = {}

        def send():
            try:
                sender.init()
                sender.send(1)
                outcome["result"] = "returned"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                outcome["result"] = exc
            outcome["at"] = time.monotonic()

        assert events.get(timeout=GUARD_S)[0] == "up"
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        kind, pid = events.get(timeout=GUARD_S)
        assert kind == "loaded", pid
        os.kill(pid, sig)
        lost_at = time.monotonic()
        thread.join(GUARD_S)
        assert not thread.is_alive(), f"send still blocked {GUARD_S:.0f} s after its receiver was lost: a hang"
        error = outcome["result"]
        assert isinstance(error, (ws.WeightSyncError, RuntimeError)), error
        if sig == signal.SIGSTOP:  # the broadcast to the silent receiver ran out of its own timeout: ours
            assert f"Timed out waiting {int(BOUND_S * 1000)}ms" in str(error), error
        print(f"send failed {outcome['at'] - lost_at:.1f} s after the receiver was lost "
              f"(bound {BOUND_S} s): {str(error).splitlines()[0][:200]}")
    finally:
        sender.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _freeze_at_next_bucket(actor) -> int:
    """Inside a GeneratorActor: its weight-sync receiver stops its own process (SIGSTOP) as it loads
    the next bucket, so it hangs in the middle of a broadcast. Returns the pid."""
    from weights.nccl import BroadcastTransport

    receiver, pid = actor._weights_in.halves[BroadcastTransport.key], os.getpid()
    load = receiver.load_weights

    def frozen(named, version):
        os.kill(pid, signal.SIGSTOP)
        return load(named, version)

    receiver.load_weights = frozen
    return pid


@pytest.mark.slow  # a Ray cluster, a learner and two generators (transformers engine)
def test_a_generator_hung_mid_sync_fails_the_learners_send_within_the_bound_and_the_sync_is_redone(tmp_path,
                                                                                                   local_ray):
    """The nccl transport (gloo on CPU) between real learner and generator actors, with
    learner.collective_timeout_s=5: a generator stops (SIGSTOP) in the middle of a sync, after the
    first bucket. The learner's send fails by itself within its bound (nobody closes the group: the
    coordinator waits on the gather), the coordinator redoes the sync, and once the generator is gone
    for good (SIGKILL; Ray restarts it) the group is rebuilt with it and the sync completes: both
    generators hold the learner's weights bit for bit."""
    import asyncio

    import ray

    from tests.sync_actors import engine_mismatches, learner_generators_coordinator, learner_weights

    learner, gens, coord = learner_generators_coordinator(tmp_path, "nccl", colocated=[False, False],
                                                           overrides=("learner.collective_timeout_s=5",))
    from queues.errors import one_line

    errors: list[str] = []  # each failed attempt's innermost error
    sync_once = coord.weights._sync_once

    async def recording(*args):
        try:
            return await sync_once(*args)
        except Exception as exc:
            errors.append(one_line(exc))
            raise

    coord.weights._sync_once = recording
    coord.log = coord.weights.log = None
    asyncio.run(coord.weights.sync(1))
    first = coord.weights.group
    assert (first.backend, first.timeout_s) == ("gloo", 5.0)  # the config's bound reached the group
    ray.get(learner.sft_step.remote([([5, 6, 7, 8, 9], [10, 11, 12])], 1e-2))  # v2 differs from v1
    pid = ray.get(gens[1].__ray_call__.remote(_freeze_at_next_bucket))

    async def sync_through_a_lost_generator() -> None:
        task = asyncio.create_task(coord.weights.sync(2))
        deadline = time.monotonic() + GUARD_S
        while not errors:
            assert not task.done() and time.monotonic() < deadline, "the learner's send never failed: a hang"
            await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGKILL)  # now Ray sees it die and restarts it; the retry rebuilds the group
        await asyncio.wait_for(task, 300)

    try:
        asyncio.run(sync_through_a_lost_generator())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert "5000ms" in errors[0] or "within 0:00:05" in errors[0], errors  # the learner's own bound
    assert coord.weights.group not in (None, first)  # rebuilt, with the restarted generator
    want = ray.get(learner.__ray_call__.remote(learner_weights))
    for g in gens:
        assert ray.get(g.__ray_call__.remote(engine_mismatches, want)) == []
        assert ray.get(g.health.remote())["version"] == 2


# ----------------------------------------------------------------------------- the whole run


def _rank_pid(launch, run_dir, rank: int, not_pid: int = 0) -> int:
    """The pid of learner rank `rank` among the launcher's descendants: the process that holds
    logs/learner-<rank>.jsonl open (every rank writes its own)."""
    from bench.faults.procs import find_pids

    log = str(run_dir / "logs" / f"learner-{rank}.jsonl")
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        for pid in find_pids(launch.proc.pid, "learner"):
            with contextlib.suppress(OSError):
                fds = os.listdir(f"/proc/{pid}/fd")
                if pid != not_pid and any(os.readlink(f"/proc/{pid}/fd/{fd}") == log for fd in fds):
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"no live learner rank {rank} holds {log}")


@pytest.mark.slow  # a whole tiny run (async, 2 learner ranks) and two relaunches
def test_a_learner_rank_hung_then_killed_mid_run_is_relaunched_each_time(tmp_path):
    """`tiny` in async mode with learner.num_ranks=2 and learner.collective_timeout_s=30: learner rank 1
    is SIGSTOPped mid-run (alive and silent: rank 0 waits for it in the step's collectives), and after
    that relaunch the new rank 1 is SIGKILLed. Each time rank 0's collective fails (by the bound, then
    at once), the launcher relaunches from the latest checkpoint, and the run ends 0 with nothing lost
    or trained twice and no process left."""
    from bench.faults.chaos import _common, _wait_log, _wait_rows, rows, verify
    from bench.faults.procs import Launch

    # The bound also covers the world's join and model load (the ranks' skew there): 30 s on a busy machine.
    steps, per_step, bound = 8, 8, 30
    run_id = "hung-rank"
    run_dir, log = tmp_path / run_id, tmp_path / "launch.log"
    launch = Launch(_common(tmp_path, run_id, steps, 25, per_step) + [
        "data.limit=8", "coordinator.checkpoint_every=2", "cluster.max_relaunches=2", "coordinator.mode=async",
        "assembler.max_staleness=1", "learner.num_ranks=2", "learner.num_cpus=0.25",
        f"learner.collective_timeout_s={bound}"], log)
    stopped = 0
    try:
        for i, sig in enumerate((signal.SIGSTOP, signal.SIGKILL)):
            assert _wait_rows(run_dir, launch, len(rows(run_dir)) + 2, 900), log.read_text()[-3000:]
            pid = _rank_pid(launch, run_dir, 1, not_pid=stopped)
            os.kill(pid, sig)
            stopped = pid if sig == signal.SIGSTOP else stopped
            assert _wait_log(log, "relaunching from", i + 1, launch, GUARD_S + bound), \
                f"no relaunch within {GUARD_S + bound:.0f} s of rank 1's {sig.name}: {log.read_text()[-3000:]}"
        rc = launch.wait(900)
    finally:
        if launch.proc.poll() is None:
            launch.wait(0)
        with contextlib.suppress(ProcessLookupError):
            if stopped:
                os.kill(stopped, signal.SIGKILL)
    relaunches = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("relaunching from")]
    assert rc == 0 and len(relaunches) == 2, log.read_text()[-3000:]
    assert f"Timed out waiting {bound * 1000}ms" in relaunches[0], relaunches  # rank 0's own bound
    r = verify(run_dir, steps, per_step)
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert launch.leftovers() == []
