"""Fixtures of the integration lane beyond tests/conftest.py's (which every lane shares).

Invariant: model_dir is built once per module and only read after; executor holds one SQL worker process,
closed after its test; no fixture here starts a cluster."""
import pytest

from tests.learners import tiny_qwen3_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tests/learners.py's random tiny Qwen3 (seed 0), once per module."""
    return tiny_qwen3_dir(tmp_path_factory)


@pytest.fixture
def executor():
    """The generator's tool executor (tasks/executor.py) with one SQL worker process, closed after the test."""
    from tasks.executor import ToolExecutor

    ex = ToolExecutor(workers=1, timeout_s=2.0, max_rows=1000)
    yield ex
    ex.close()
