"""Shared fixtures: a real redis-server per test (started in ~15 ms on a unix socket)."""
import pytest

from queues.redis_server import EmbeddedRedis


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def local_ray(monkeypatch):
    """A real local Ray (2 CPUs, no dashboard) in its own temp dir; workers import this repo."""
    import os
    import shutil
    import tempfile

    ray = pytest.importorskip("ray")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    temp_dir = tempfile.mkdtemp(prefix="ray-test-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
