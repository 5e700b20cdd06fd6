"""The launcher's command line on a config (python -m launch.cluster --help, a bad key) as a subprocess, and the
local Ray start the launcher makes from a run's config (ray.init faked: its arguments and retries are checked)."""
import json
import subprocess
import sys

import pytest

from config import apply_overrides
from config.recipes import RECIPES, get_recipe


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.cluster", *args], capture_output=True, text=True, timeout=60)


def test_cli_lists_recipes_and_prints_config():
    out = _cli("--help")
    assert out.returncode == 0
    for name in RECIPES:
        assert name in out.stdout
    printed = _cli("bird_32b", "learner.lr=3e-6", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["learner"]["lr"] == 3e-6


def test_cli_bad_key_is_one_line_and_exit_2():
    out = _cli("tiny", "generator.n_sample=4")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: unknown config key 'generator.n_sample'; closest: generator.n_samples, generator.stop, generator.seed"
    assert _cli("tinyy").stderr.strip() == "error: unknown recipe 'tinyy'; did you mean tiny, tiny_mt, tiny_lora?"


def test_a_local_ray_start_that_timed_out_is_tried_again_fake_ray_init(monkeypatch):
    """Ray waits a fixed 30 s for its raylet; on an overloaded machine that runs out. The launcher tries
    a local start LOCAL_RAY_ATTEMPTS times (ray.init stands in: a real timeout needs a starved machine);
    any other error, or the last timeout, is raised as it was."""
    import ray

    from launch import local_ray

    calls, shutdowns, left = [], [], []

    def init(**kw):
        calls.append(kw["address"])
        if len(calls) < 3:
            # what a timed-out ray.init leaves running (its GCS, dashboard, monitors): ray.shutdown() does not know it
            left.append(subprocess.Popen(["sleep", "120"]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = apply_overrides(get_recipe("tiny"), [])
    log = __import__("structlog").get_logger()
    local_ray.start_ray(cfg, None, log)
    assert calls == ["local"] * 3 and len(shutdowns) == 2
    assert [p.wait(timeout=30) for p in left] == [-9, -9]  # the failed attempts' processes are gone
    calls.clear()
    monkeypatch.setattr(local_ray, "LOCAL_RAY_ATTEMPTS", 2)
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.start_ray(cfg, None, log)
    assert len(calls) == 2

    def broken(**kw):
        calls.append(1)
        raise RuntimeError("port taken")

    calls.clear()
    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(RuntimeError, match="port taken"):
        local_ray.start_ray(cfg, None, log)
    assert calls == [1]  # not a timeout: no retry


def test_a_local_cluster_inherits_the_run_env_and_tiny_has_no_dashboard_fake_ray_init(monkeypatch):
    """A local cluster gets run_env() through the environment ray.init starts it in (no runtime_env: that
    sends every worker through Ray's runtime-env agent), restored after; cluster.dashboard picks Ray's
    dashboard (tiny: off). A joined cluster gets run_env() as the job's runtime_env. (ray.init stands in.)"""
    import os

    import ray

    from launch import local_ray

    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append((kw, dict(os.environ))))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.setenv("ARL_PROBE", "x")
    log = __import__("structlog").get_logger()
    for overrides, dashboard in (([], False), (["cluster.dashboard=true"], True)):
        local_ray.start_ray(apply_overrides(get_recipe("tiny"), overrides), None, log)
        kw, env = seen.pop()
        assert kw["address"] == "local" and kw["include_dashboard"] is dashboard and "runtime_env" not in kw
        assert env["OMP_NUM_THREADS"] == "1" and env["ARL_PROBE"] == "x" and env["PYTHONPATH"].startswith(str(local_ray.Path(local_ray.__file__).resolve().parent.parent))
        assert env["RAY_worker_niceness"] == "0"  # the actors at the launcher's priority, not 15 below it
        assert "OMP_NUM_THREADS" not in os.environ and "RAY_worker_niceness" not in os.environ  # restored
    assert get_recipe("bird_32b").cluster.dashboard is True
    local_ray.start_ray(apply_overrides(get_recipe("tiny"), ["cluster.ray_address=127.0.0.1:6379"]), None, log)
    kw, _ = seen.pop()
    assert kw["address"] == "127.0.0.1:6379" and kw["runtime_env"] == {"env_vars": local_ray.run_env()}

