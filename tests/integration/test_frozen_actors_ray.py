"""Every wait on an actor has a bound, on a real local Ray: a SIGSTOPped learner rank ends the group's call within its
bound naming the rank, a timeout is handled as a death by the launcher (Ray's own errors beside it), and teardown
waits once for a SIGSTOPped consumer and leaves no actor."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from actors.shell import ActorCallTimeout
from config import RunContext, apply_overrides
from config.recipes import get_recipe
from tests.standins import LoopingConsumer


def _cfg(*overrides: str):
    return apply_overrides(get_recipe("tiny"), ["coordinator.call_timeout_s=0.5", "generator.pause_timeout_s=0.25",
                                                "coordinator.step_timeout_s=2", *overrides])


@pytest.mark.slow  # two learner ranks (each imports torch and DeepSpeed) on a real local Ray
def test_a_sigstopped_learner_rank_ends_the_group_s_call_within_its_bound_naming_the_rank(tmp_path):
    from launch.create import create_learner
    from launch.run import actor_died
    from tasks.tiny_model import build_tiny
    from tests.clusters import ray_cluster

    cfg = _cfg("learner.num_ranks=2", "learner.num_cpus=0.5", "learner.dtype=float32", "learner.device=cpu",
               "coordinator.call_timeout_s=5")
    model_dir = build_tiny(tmp_path / "model", model_cfg=cfg.model, seed=0)
    with ray_cluster():
        group = create_learner(cfg, RunContext.of(cfg, "frozen", tmp_path, ""), model_dir, 10, "frozen")
        try:
            asyncio.run(group.sleep())  # both ranks answer
            pid = asyncio.run(asyncio.wait_for(_pid_of(group.ranks[1]), 60))
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(ActorCallTimeout) as e:
                asyncio.run(group.wake())
            waited = time.monotonic() - t0
            os.kill(pid, signal.SIGCONT)
        finally:
            group.kill()
    assert str(e.value) == "learner.wake on rank(s) [1] of 2 did not return within 5 s (the actor is frozen or overloaded)"
    assert waited >= 5.0 and actor_died(e.value)


async def _pid_of(rank):
    return await rank.pid.remote()


class _Consumer(LoopingConsumer):
    """A generator's stand-in for the launcher's teardown: a loop that stop() ends, and close()."""

    def pid(self):
        return os.getpid()


def test_teardown_waits_once_for_a_sigstopped_consumer_and_leaves_no_actor(local_ray):
    """launch.place.stop_actors after a freeze (the relaunch's teardown): a SIGSTOPped generator does not
    answer its stop; it is not asked to close as well (that second wait, a whole timeout_s more, is what
    every relaunch after a freeze spent), the live one closes, and both are killed: none is left."""
    import ray
    import structlog

    from launch.place import stop_actors

    cls = ray.remote(num_cpus=0)(_Consumer)
    live, frozen = (cls.options(name=f"teardown:generator-{i}").remote() for i in range(2))
    loops = [a.run.remote() for a in (live, frozen)]
    pid = ray.get(frozen.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        out = stop_actors("teardown", [live, frozen], [], None, None, None, loops, structlog.get_logger(), timeout_s=4.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert out["unresponsive"] == 1 and out["loops_drained"] == 1 and out["alive"] == 0, out
    assert out["s"] < 2 * 4.0, out  # one bound, not two


def test_a_timeout_is_handled_as_a_death_by_the_launcher():
    from launch.run import actor_died

    assert actor_died(ActorCallTimeout("generator-0.sleep did not return within 1 s"))
    wrapped = RuntimeError("the coordinator's run failed")
    wrapped.__cause__ = ActorCallTimeout("learner.sleep on rank(s) [1] of 2 did not return within 1 s")
    assert actor_died(wrapped)
    assert not actor_died(RuntimeError("a bug"))
