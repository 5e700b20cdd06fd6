"""What a long-lived actor keeps in memory does not grow with the steps it has run (issue 27: RSS growth
<= 10 % over an hour): only the ledger (one outcome per published task, checkpointed and read back by
bench.faults.chaos's verdict) grows with the run, by design.

The coordinator's step loop runs here as in the actor, with its actor calls standing in (fake: plain
coroutines; no Redis, no Ray) so that only its own bookkeeping is measured. A local Ray we start caps the
task history its GCS keeps (Ray's default grows gcs_server by ~3.4 kB per actor call up to 100,000 calls)."""
from __future__ import annotations

import os

from actors.coordinator.coordinator import Coordinator
from config import RunContext, apply_overrides
from config.recipes import get_recipe
from queues.messages import train_task_id

BY_DESIGN = {"ledger"}  # grows by one entry per published task: the run's accounting (docstring above)


def _held(obj) -> dict[str, int]:
    """Every container attribute of an instance, by its length."""
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (dict, list, set, tuple)) and k not in BY_DESIGN}


async def _run_fake_actor_calls_coordinator(steps: int) -> dict[str, int]:
    cfg = apply_overrides(get_recipe("tiny"), [f"coordinator.steps={steps}", "coordinator.eval_every=0",
                                               "coordinator.checkpoint_every=0", "coordinator.prompts_per_step=4"])
    coord = Coordinator(cfg, RunContext(run_id="mem"), list(range(32)), [], generators=[], learner=None, assembler=None)

    async def publish(task_ids):
        return task_ids

    async def run_step(step, task_ids, next_publish=None):
        for t in task_ids:
            coord.generated.done[t] = 0.0  # what the events consumer records for each generated group
        coord.ledger.update({t: "trained" for t in task_ids})
        return {"time_step": 0.01, "prompts": float(len(task_ids)), **{f"metric_{i}": float(i) for i in range(40)}}

    async def nothing(*args):
        return None

    coord._tasks = lambda step, indices, version, first_slot=0: [train_task_id(step, first_slot + k)
                                                                  for k in range(len(indices))]
    coord._publish, coord.run_step = publish, run_step
    coord.assembler.forget_before = coord.save_checkpoint = coord._rest_generators = nothing
    out = await coord._steps()
    assert out["steps"] == steps and out["ledger_size"] == 4 * steps  # the run really ran its steps
    return {**_held(coord), **{f"generated.{k}": n for k, n in _held(coord.generated).items()}}


async def test_the_coordinator_s_state_besides_its_ledger_does_not_grow_with_steps_fake_actor_calls():
    short, long = await _run_fake_actor_calls_coordinator(5), await _run_fake_actor_calls_coordinator(60)
    grown = {k: (short.get(k), n) for k, n in long.items() if n > short.get(k, 0)}
    assert not grown, f"the coordinator holds more after 60 steps than after 5 (attribute: (5 steps, 60 steps)): {grown}"
    assert "generated.done" in long  # the comparison saw the coordinator's maps


def _gcs_environ(ray) -> dict[str, str]:
    """The environment of the local cluster's gcs_server (found by its session directory)."""
    session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            if b"gcs_server" in cmd.split(b"\0")[0] and session.encode() in cmd:
                env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
                return dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)
        except OSError:
            continue
    raise AssertionError(f"no gcs_server of session {session}")


def test_a_local_ray_s_gcs_keeps_a_bounded_task_history(local_ray):
    """Ray's default (100,000 tasks' events in the GCS, ~3.4 kB each) grew gcs_server by ~2.4 MB a minute in
    the hour soak; the clusters we start cap it (launch.local_ray.LOCAL_RAY_ENV)."""
    from launch.local_ray import LOCAL_RAY_ENV

    assert int(LOCAL_RAY_ENV["RAY_task_events_max_num_task_in_gcs"]) <= 10_000
    assert _gcs_environ(local_ray)["RAY_task_events_max_num_task_in_gcs"] == LOCAL_RAY_ENV["RAY_task_events_max_num_task_in_gcs"]

