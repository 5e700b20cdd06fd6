"""Actors built by the launcher's one way (actors.shell.spawn) on a real local Ray: their process runs with the
cyclic collector back on after the build, what the build left alive is frozen, and what it dropped in a reference
cycle is freed, not frozen (built_with_gc_paused)."""
from __future__ import annotations

import gc
import weakref

from actors.assembler import Assembler
from actors.shell import built_with_gc_paused, spawn
from config import AssemblerConfig, RunContext


def _collector(actor) -> tuple[bool, int]:
    return gc.isenabled(), gc.get_freeze_count()


class _Cycle:
    def __init__(self):
        self.me = self


class DropsACycle:
    """Stands in for a model load that leaves its temporaries in a reference cycle."""

    @built_with_gc_paused
    def __init__(self, section, ctx):
        dropped = _Cycle()
        self.dropped = weakref.ref(dropped)
        self.paused = not gc.isenabled()
        del dropped  # garbage now, reachable only from itself

    def seen(self) -> tuple[bool, bool, bool, int]:
        return self.paused, self.dropped() is None, gc.isenabled(), gc.get_freeze_count()


def test_a_spawned_actor_runs_with_the_collector_on_and_its_build_frozen(local_ray, tmp_path):
    actor = spawn(Assembler, AssemblerConfig(), RunContext(run_id="gc", run_dir=str(tmp_path)),
                  options=dict(num_cpus=0.1), consumer="assembler-gc")
    enabled, frozen = local_ray.get(actor.__ray_call__.remote(_collector), timeout=120)
    assert enabled and frozen > 10_000, (enabled, frozen)  # Ray's and our modules at least, never walked again
    local_ray.kill(actor)
    other = spawn(DropsACycle, None, RunContext(), options=dict(num_cpus=0.1))
    paused, freed, enabled, frozen = local_ray.get(other.seen.remote(), timeout=120)
    assert paused and freed and enabled and frozen > 10_000, (paused, freed, enabled, frozen)  # garbage never frozen
    local_ray.kill(other)
