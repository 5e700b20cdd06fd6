"""What the light processes import, checked in a fresh interpreter (a subprocess): the coordinator, the assembler and
the launcher's modules import no torch, transformers or DeepSpeed."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_light_actors_import_no_torch():
    """The coordinator and the assembler move messages and metrics, never a tensor: importing them (what
    their Ray worker does) imports no torch (~230 MB of RSS in each process), nor does `weights`, nor
    the learner's shell (Ray imports an actor's module where a handle to it is unpickled: the
    coordinator holds the learner ranks' handles)."""
    import subprocess
    import sys

    code = ("import sys; import actors.coordinator.coordinator, actors.assembler, actors.learner.shell, weights, "
            "weights.strategy, weights.store; print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_the_launchers_modules_import_no_torch():
    """The launcher lives as long as the run: its own modules import no torch, transformers or DeepSpeed (the
    inputs that need them are built in a child process, launch/inputs.py; tests/e2e/test_tiny_e2e.py checks a
    whole run's launcher, through its `run finished` line), nor does the learner group's rendezvous
    (actors.learner.world: the launcher joins a world of several ranks through world_hosts)."""
    import subprocess
    import sys

    code = ("import sys; import launch.cluster, launch.run, launch.place, launch.inputs, launch.warm_start, "
            "launch.startup_memory, launch.progress, launch.export, actors.learner.world; "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

