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
