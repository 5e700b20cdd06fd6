import json

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


def test_ray_dashboard_is_skipped_when_its_modules_are_missing(monkeypatch):
    """A bare `ray` wheel (no aiohttp_cors) cannot start the dashboard: the launcher turns it off
    instead of failing in ray.init."""
    import importlib.util

    from launch import local_ray

    assert local_ray.dashboard_available() is True  # the dev install has ray[default]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp_cors" else real(name, *a))
    assert local_ray.dashboard_available() is False


def test_validation_resolves_every_auto_and_the_saved_config_loads_back_the_same():
    """Every `auto` is resolved once, in validation (the weight transport and the learner's world size
    through the placement, the devices, the correction): a run's config.json holds no "auto" and
    validates back to the same config; a Coordinator refuses an unresolved one."""

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
