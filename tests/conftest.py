"""Shared fixtures: a real redis-server per test (started in ~15 ms on a unix socket), and the tiny
model + tokenizer built once per session (`tiny_dir`: float32, seed 0; tests only read it)."""
import contextlib
import os
import shutil
import tempfile

import pytest

from queues.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tasks.tiny_model's model and tokenizer in one directory, built once for the whole session."""
    from config import ModelConfig
    from tasks.tiny_model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_model"), model_cfg=ModelConfig(source="tiny", dtype="float32"), seed=0)


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@contextlib.contextmanager
def ray_cluster(prefix: str = "ray-test-"):
    """A real local Ray (2 CPUs, no dashboard) in its own temp dir, whose workers import this repo.

    `address="local"` always starts a new cluster (never joins one another test or process left).
    PYTHONPATH is restored afterwards. Used by the `local_ray` fixture and by module-scoped ones.
    """
    ray = pytest.importorskip("ray")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root + os.pathsep + (saved or "")
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
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


@pytest.fixture
def local_ray():
    """A real local Ray for one test (see ray_cluster)."""
    with ray_cluster() as ray:
        yield ray


# The fast lane (`pytest -m "not slow"`, README): everything but these files, which start a whole run
# (launcher, Ray cluster, several actors) or a server. CI still runs everything.
SLOW_FILES = frozenset({
    "test_tiny_e2e.py", "test_chaos.py", "test_preflight.py", "test_learner_ranks.py", "test_serve.py",
    "test_export.py", "test_weight_sync_actors.py", "test_security.py", "test_tiny_episodes_e2e.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
