"""A real local Ray for the tests that need one (the conftest's `local_ray` fixture, module-scoped fixtures).

Invariant: `ray_cluster` always starts a new cluster in its own temp dir (never joins one another test or
process left), shuts it down and removes the dir on exit, and puts PYTHONPATH back as it found it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest


@contextlib.contextmanager
def ray_cluster(prefix: str = "ray-test-"):
    """A real local Ray (2 CPUs, no dashboard) in its own temp dir, whose workers import this repo.

    `address="local"` always starts a new cluster (never joins one another test or process left), tried
    again when Ray's fixed 30 s raylet wait runs out on a loaded machine (launch.local_ray.init_local_ray).
    PYTHONPATH is restored afterwards. Used by the `local_ray` fixture and by module-scoped ones.
    """
    ray = pytest.importorskip("ray")
    from launch.local_ray import init_local_ray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root + os.pathsep + (saved or "")
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        init_local_ray(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
