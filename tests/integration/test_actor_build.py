"""An actor built by the launcher's one way (actors.shell.spawn) on a real local Ray: its process runs with the
cyclic collector back on after the build, and what the build left alive is frozen (built_with_gc_paused)."""
from __future__ import annotations

import gc

from actors.assembler import Assembler
from actors.shell import spawn
from config import AssemblerConfig, RunContext


def _collector(actor) -> tuple[bool, int]:
    return gc.isenabled(), gc.get_freeze_count()


def test_a_spawned_actor_runs_with_the_collector_on_and_its_build_frozen(local_ray, tmp_path):
    actor = spawn(Assembler, AssemblerConfig(), RunContext(run_id="gc", run_dir=str(tmp_path)),
                  options=dict(num_cpus=0.1), consumer="assembler-gc")
    enabled, frozen = local_ray.get(actor.__ray_call__.remote(_collector), timeout=120)
    assert enabled and frozen > 10_000, (enabled, frozen)  # Ray's and our modules at least, never walked again
    local_ray.kill(actor)
