import json
import subprocess
import sys

import msgspec
import pytest

from config import ConfigError, RunConfig, RunContext, apply_overrides, check_inputs
from config.recipes import RECIPES, get_recipe


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_is_a_valid_config(name):
    cfg = get_recipe(name)
    assert isinstance(cfg, RunConfig)
    apply_overrides(cfg, [])  # validates


def test_overrides_are_converted_to_the_field_type():
    cfg = apply_overrides(get_recipe("tiny"), ["learner.lr=2e-6", "generator.n_samples=8", "learner.betas=0.9,0.95",
                                               "coordinator.resume=true", "name=123", "generator.stop=[\"</s>\"]"])
    assert cfg.learner.lr == 2e-6 and isinstance(cfg.learner.lr, float)
    assert cfg.generator.n_samples == 8
    assert cfg.learner.betas == [0.9, 0.95]
    assert cfg.coordinator.resume is True
    assert cfg.name == "123"
    assert cfg.generator.stop == ["</s>"]


def test_recipes_do_not_share_mutable_defaults():
    a = get_recipe("bird_32b")
    b = get_recipe("tiny")
    assert a.generator.tensor_parallel_size == 4 and b.generator.tensor_parallel_size == 1


def test_nested_engine_kwargs_stay_plain_dicts():
    cfg = apply_overrides(get_recipe("bird_32b"), ["generator.engine_kwargs.compilation_config.level=3",
                                                   'generator.engine_kwargs.speculative_config={"num_speculative_tokens": 3}'])
    kwargs = cfg.generator.engine_kwargs
    assert type(kwargs) is dict and type(kwargs["compilation_config"]) is dict
    assert kwargs == {"compilation_config": {"level": 3}, "speculative_config": {"num_speculative_tokens": 3}}


@pytest.mark.parametrize("override, message", [
    ("learner.lrr=1", "unknown config key 'learner.lrr'; closest: learner.lr"),
    ("lerner.lr=1", "unknown config key 'lerner.lr'; closest: learner.lr"),
    ("learner.lr=fast", "config key 'learner.lr': Expected `float`, got `str` (value 'fast')"),
    ("generator.n_samples=eight", "config key 'generator.n_samples': Expected `int`, got `str` (value 'eight')"),
    ("generator.engine=tgi", "config key 'generator.engine': Invalid enum value 'tgi'"),
    ("learner=3", "config key 'learner' is a section"),
    ("learner.lr.x=3", "config key 'learner.lr' is a value, not a section"),
    ("learner.zero_stage=5", "config key 'learner.zero_stage': must be 0, 1, 2 or 3"),
    ("learner.betas=0.9", "config key 'learner.betas': needs two values"),
    ("learner.checkpoint_layers=-2", "config key 'learner.checkpoint_layers': must be -1 (every layer) or >= 0"),
    ("cluster.max_relaunches=-1", "config key 'cluster.max_relaunches': must be >= 0"),
    ("learner.collective_timeout_s=0", "config key 'learner.collective_timeout_s': must be > 0"),
    ("generator.max_turns=0", "config key 'generator.max_turns': must be >= 1"),
    ("generator.max_observation_tokens=2", "config key 'generator.max_observation_tokens': must be >= 8"),
    ("generator.tool_workers=0", "config key 'generator.tool_workers': must be >= 1"),
    ("generator.tool_timeout_s=-1", "config key 'generator.tool_timeout_s': must be >= 0"),
    ("generator.tool_max_rows=-5", "config key 'generator.tool_max_rows': must be >= 0"),
    ("noequals", "is not of the form key=value"),
])
def test_bad_overrides_get_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(get_recipe("tiny"), [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_real_runs_need_model_and_data_paths():
    cfg = get_recipe("bird_32b")
    cfg.model.path = ""
    with pytest.raises(ConfigError, match="model.path"):
        check_inputs(cfg)
    with pytest.raises(ConfigError, match="data.bird_dir"):
        check_inputs(get_recipe("bird_32b"))


def test_a_multi_node_run_needs_a_redis_every_node_reaches(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    cfg = get_recipe("bird_32b")  # 4 nodes
    cfg.model.path, cfg.data.bird_dir = "/models/q", "/data/bird"
    with pytest.raises(ConfigError, match="cluster.redis_url") as err:
        check_inputs(cfg)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("REDIS_URL", "redis://head:6379/0")
    check_inputs(cfg)
    one = get_recipe("bird_1p7b")  # one node: the embedded server serves it
    one.model.path, one.data.bird_dir = "/models/q", "/data/bird"
    monkeypatch.delenv("REDIS_URL")
    check_inputs(one)


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


def test_ray_dashboard_is_skipped_when_its_modules_are_missing(monkeypatch):
    """A bare `ray` wheel (no aiohttp_cors) cannot start the dashboard: the launcher turns it off
    instead of failing in ray.init."""
    import importlib.util

    from launch import local_ray

    assert local_ray.dashboard_available() is True  # the dev install has ray[default]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp_cors" else real(name, *a))
    assert local_ray.dashboard_available() is False


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


def test_validation_resolves_every_auto_and_the_saved_config_loads_back_the_same():
    """Every `auto` is resolved once, in validation (the weight transport and the learner's world size
    through the placement, the devices, the correction): a run's config.json holds no "auto" and
    validates back to the same config; a Coordinator refuses an unresolved one."""
    import json

    from actors.coordinator.coordinator import Coordinator
    from config import RunConfig, validate

    raw = RunConfig()
    assert raw.coordinator.weight_sync == "auto" and raw.learner.correction == "auto"
    for recipe in ("tiny", "bird_1p7b", "bird_32b"):
        cfg = apply_overrides(get_recipe(recipe), [])
        text = msgspec.json.encode(cfg).decode()
        assert '"auto"' not in text, (recipe, [k for k, v in msgspec.to_builtins(cfg).items() if "auto" in json.dumps(v)])
        assert validate(json.loads(text)) == cfg
    assert apply_overrides(get_recipe("bird_1p7b"), []).learner.num_ranks == 8  # colocated: every GPU a rank
    assert apply_overrides(get_recipe("tiny"), []).coordinator.weight_sync == "object_store"
    with pytest.raises(ValueError, match="validated config"):
        Coordinator(raw, RunContext(run_id="r", run_dir="/tmp/arl-unused", redis_url="redis://unused"), [], [],
                    generators=[], learner=None, assembler=None)


def test_a_seed_override_seeds_the_data_and_the_sampling_unless_they_are_given():
    cfg = apply_overrides(get_recipe("tiny"), ["seed=3"])
    assert (cfg.seed, cfg.data.synthetic_seed, cfg.generator.seed) == (3, 3, 3)
    cfg = apply_overrides(get_recipe("tiny"), ["generator.seed=9", "seed=3"])
    assert (cfg.seed, cfg.data.synthetic_seed, cfg.generator.seed) == (3, 3, 9)
    cfg = apply_overrides(get_recipe("tiny"), ["data.synthetic_seed=5"])
    assert (cfg.seed, cfg.data.synthetic_seed, cfg.generator.seed) == (0, 5, 0)


def test_tool_limits_default_to_the_scorer_s():
    cfg = apply_overrides(get_recipe("tiny"), ["generator.max_turns=3"])
    assert (cfg.generator.tool_timeout_s, cfg.generator.tool_max_rows) == (cfg.scorer.timeout_s, cfg.scorer.max_rows)
    cfg = apply_overrides(get_recipe("tiny"), ["generator.tool_timeout_s=1.5", "generator.tool_max_rows=7"])
    assert (cfg.generator.tool_timeout_s, cfg.generator.tool_max_rows) == (1.5, 7)
