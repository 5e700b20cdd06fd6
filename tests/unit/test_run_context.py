"""RunContext and the one way actors are built (plain classes, no Ray): config section + RunContext."""
import dataclasses
import gc
import inspect
import json
import pickle

import pytest
import structlog

from actors.assembler import Assembler
from actors.coordinator.coordinator import Coordinator
from actors.generator.shell import GeneratorShell
from actors.learner.shell import LearnerShell
from actors.scorer import ScorerShell
from actors.shell import RESTARTABLE, built_with_gc_paused, in_actor_process
from config import AssemblerConfig, RunContext, apply_overrides
from config.recipes import get_recipe

ACTORS = (Coordinator, Assembler, ScorerShell, GeneratorShell, LearnerShell)


@pytest.fixture
def restore_logging():
    yield
    from observe import logs

    structlog.reset_defaults()  # the actor under test configured this process's structlog
    logs._configured.clear()


def test_the_context_of_a_run_carries_its_settings_is_frozen_and_pickles():
    cfg = apply_overrides(get_recipe("tiny"), ["cluster.reclaim_idle_s=7", "cluster.stream_high_water=99",
                                               "logging.level=debug"])
    ctx = RunContext.of(cfg, "r1", "/runs/r1", "redis://h:1", data_dir="/runs/r1/data")
    assert (ctx.run_id, ctx.run_dir, ctx.redis_url, ctx.data_dir) == ("r1", "/runs/r1", "redis://h:1", "/runs/r1/data")
    assert (ctx.reclaim_idle_s, ctx.stream_high_water, ctx.log_level) == (7.0, 99, "debug")
    assert pickle.loads(pickle.dumps(ctx)) == ctx  # travels to any Ray actor as is
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.redis_url = "redis://elsewhere"
    assert RunContext() == RunContext(run_id="", run_dir="", redis_url="")  # "none here": a plain test's
    secret = RunContext(run_id="r", redis_url="redis://:hunter2@h:6379/0")
    assert "hunter2" not in repr(secret) and "run_id='r'" in repr(secret)  # a logged context leaks no password


def test_every_actor_is_built_from_its_section_and_the_context_with_its_ray_options_on_the_class():
    for cls in ACTORS:
        params = list(inspect.signature(cls.__init__).parameters)
        assert params[2] == "ctx", (cls.__name__, params)
        assert "redis_url" not in params and "run_dir" not in params and "run_id" not in params, cls.__name__
        assert isinstance(cls.RAY_OPTIONS, dict), cls.__name__
    restartable = {c.__name__ for c in ACTORS if all(c.RAY_OPTIONS.get(k) == v for k, v in RESTARTABLE.items())}
    assert restartable == {"Assembler", "ScorerShell", "GeneratorShell"}  # the learner and coordinator relaunch


def test_every_actor_builds_with_the_collector_paused_and_a_test_process_keeps_it_unfrozen():
    builders = [cls.__init__ for cls in ACTORS] + [LearnerShell.join]
    assert all(getattr(b, "__wrapped__", None) is not None and b.__code__ is built_with_gc_paused(len).__code__
               for b in builders), [b.__qualname__ for b in builders]
    seen = []

    @built_with_gc_paused
    def build(fail: bool = False):
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("bad section")
        return "built"

    frozen = gc.get_freeze_count()
    assert build() == "built" and seen == [False] and gc.isenabled()
    assert not in_actor_process() and gc.get_freeze_count() == frozen  # a test's process drops what it built
    with pytest.raises(ValueError, match="bad section"):
        build(fail=True)
    assert seen == [False, False] and gc.isenabled()  # back on after a build that raised
    gc.disable()
    try:
        build()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_an_actor_logs_where_and_at_the_level_its_context_says(tmp_path, restore_logging):
    ctx = RunContext(run_id="lg", run_dir=str(tmp_path), log_level="warning")
    Assembler(AssemblerConfig(), ctx, consumer="assembler-7")
    log = structlog.get_logger("t")
    log.info("below the level")
    log.warning("kept", n=1)
    lines = [json.loads(line) for line in (tmp_path / "logs" / "assembler-7.jsonl").read_text().splitlines()]
    assert [(e["event"], e["level"]) for e in lines] == [("kept", "warning")]


def test_without_redis_in_its_context_a_stage_says_so(tmp_path):
    import asyncio

    asm = Assembler(AssemblerConfig())
    with pytest.raises(RuntimeError, match="redis_url"):
        asyncio.run(asm.collect(0, ["0:0:0"], version=0, timeout_s=1.0))


