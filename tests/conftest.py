"""Fixtures every lane shares (tests/unit, tests/integration, tests/e2e): a real redis-server per test (started
in ~15 ms on a unix socket), and the tiny model + tokenizer built once per session (`tiny_dir`: float32, seed 0; tests only read it).

Invariant: no test module leaves torch.distributed's variables (DIST_ENV: RANK, WORLD_SIZE, ...) in
the pytest process's environment; a module that builds a Learner in-process (which sets them for
DeepSpeed) uses `learner_process_env`, and the last test of a module that leaks them fails in its
teardown, naming the variables (the environment is put back for the next module)."""
import os

import pytest

from queues.redis_server import EmbeddedRedis
from tests.clusters import ray_cluster


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tasks.tiny_model's model and tokenizer in one directory, built once for the whole session."""
    from config import ModelConfig
    from tasks.tiny_model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_model"), model_cfg=ModelConfig(source="tiny", dtype="float32"), seed=0)


# torch.distributed's and DeepSpeed's per-process variables: a process (or a later test's subprocess,
# e.g. bench.peers') that inherits RANK believes it is a rank of some world.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


@pytest.fixture(scope="module")
def learner_process_env():
    """For a module that builds a Learner in the pytest process: the world-of-one variables DeepSpeed
    reads and the loopback interface its gloo group binds (actors/learner/engine.py ensure_process_group),
    set for the module and removed after it. Use it as
    `pytestmark = pytest.mark.usefixtures("learner_process_env")`."""
    from actors.learner.world import LOOPBACK, interface_of

    with pytest.MonkeyPatch.context() as mp:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                           ("GLOO_SOCKET_IFNAME", interface_of(LOOPBACK) or "lo")):
            mp.setenv(key, value)
        yield


def _dist_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in DIST_ENV}


_MODULE_ENV: dict[str, dict[str, str | None]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _MODULE_ENV.setdefault(item.nodeid.split("::")[0], _dist_env())  # before the module's fixtures
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures torn down): DIST_ENV as the module found it."""
    result = yield
    module = item.nodeid.split("::")[0]
    if nextitem is not None and nextitem.nodeid.split("::")[0] == module:
        return result
    before, after = _MODULE_ENV.pop(module, None), _dist_env()
    if before is not None and after != before:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        leaked = ", ".join(f"{k}={after[k]}" for k in DIST_ENV if after[k] != before[k])
        raise AssertionError(f"{module} left {leaked} in the pytest process's environment (a Learner built "
                             f"in-process? use the learner_process_env fixture, or monkeypatch.setenv)")
    return result


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def local_ray():
    """A real local Ray for one test (see ray_cluster)."""
    with ray_cluster() as ray:
        yield ray
