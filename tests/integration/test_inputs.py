"""launch/inputs.py: the run's inputs built in a spawned child process (so the launcher never imports torch
or transformers) are the inputs the launcher would build itself, a child past its bound is ended with one
line, and a failure inside it reaches the launcher as the same exception."""
from __future__ import annotations

import multiprocessing

import pytest
import structlog

from config import ConfigError, apply_overrides
from config.recipes import get_recipe
from launch.inputs import build_in_child

SMALL = ["data.synthetic_databases=2", "data.synthetic_questions=80", "data.synthetic_held_out_databases=1",
         "model.tiny_sft_steps=3", "model.tiny_sft_batch=4", "seed=5"]


def test_the_childs_prompts_and_warm_start_draws_are_the_launchers_own(tmp_path):
    from launch.inputs import load_prompts
    from launch.warm_start import draw

    cfg = apply_overrides(get_recipe("tiny"), SMALL)
    got = build_in_child(cfg, tmp_path).result(timeout_s=600)
    assert not multiprocessing.active_children()  # the child has exited
    assert got.model_path == str(tmp_path / "model") and (tmp_path / "model" / "config.json").exists()
    log = structlog.get_logger("test")
    train, held = load_prompts(cfg, got.model_path, got.bird_dir, log)  # here, from the child's model and data
    assert [i.prompt_tokens for i in got.train_items] == [i.prompt_tokens for i in train] and train
    assert [i.prompt_tokens for i in got.eval_items] == [i.prompt_tokens for i in held] and held
    here = draw(cfg, train, got.model_path)
    assert len(got.draws) == len(here) == 3 and got.draws.chunk(0, 3) == here.chunk(0, 3)
    assert (got.draws.slips, got.draws.drawn) == (here.slips, here.drawn) and got.draws.drawn == 12
    # The child's log lines are the launcher's.
    assert "building tiny tokenizer and model" in (tmp_path / "logs" / "launcher.jsonl").read_text()


def test_a_failure_in_the_child_is_the_same_one_line_error(tmp_path):
    cfg = apply_overrides(get_recipe("tiny"), SMALL + ["data.max_prompt_tokens=8"])
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        build_in_child(cfg, tmp_path).result(timeout_s=600)
    assert not multiprocessing.active_children()


def test_a_child_past_its_bound_is_ended_with_one_line(tmp_path):
    cfg = apply_overrides(get_recipe("tiny"), SMALL)
    pending = build_in_child(cfg, tmp_path)
    with pytest.raises(ConfigError, match="not ready within 0.01 s"):
        pending.result(timeout_s=0.01)
    assert not multiprocessing.active_children()
