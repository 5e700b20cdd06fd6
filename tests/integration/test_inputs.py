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


def test_tiny_prompts_rendered_without_transformers_are_transformers_own_ids(tmp_path):
    """tiny's prompts are tokenized with `tokenizers` alone (launch/inputs.py prompt_tokenizer): the ids must be
    those transformers' tokenizer gives over the same tokenizer.json, every train and held-out prompt."""
    from transformers import AutoTokenizer

    from launch.inputs import load_prompts, prompt_tokenizer
    from tasks.bird import build_prompts, load_split

    cfg = apply_overrides(get_recipe("tiny"), SMALL + ["model.tiny_sft_steps=0"])
    got = build_in_child(cfg, tmp_path).result(timeout_s=600)
    assert type(prompt_tokenizer(cfg, got.model_path)).__module__.startswith("tokenizers")
    train, held = load_prompts(cfg, got.model_path, got.bird_dir, structlog.get_logger("test"))
    hf = AutoTokenizer.from_pretrained(got.model_path)
    for split, items in ((cfg.data.train_split, train), (cfg.data.eval_split, held)):
        ref, _ = build_prompts(load_split(got.bird_dir, split), hf, cfg.data.max_prompt_tokens, style="compact",
                               sample_values=cfg.data.sample_values)
        assert items and [i.prompt_tokens for i in items] == [i.prompt_tokens for i in ref]


def test_a_run_from_a_built_tiny_model_builds_its_inputs_without_torch(tmp_path):
    """A run whose model/ is already built (from an export, or resumed) reuses it, and its inputs' child then
    imports neither torch nor transformers (the start-up's CPU: docs/perf/peers.md)."""
    import subprocess
    import sys

    cfg = apply_overrides(get_recipe("tiny"), SMALL + ["model.tiny_sft_steps=0"])
    build_in_child(cfg, tmp_path).result(timeout_s=600)  # builds model/ and data/
    code = ("import sys, structlog; from pathlib import Path; from config import apply_overrides; "
            "from config.recipes import get_recipe; from launch.inputs import build; "
            f"cfg = apply_overrides(get_recipe('tiny'), {SMALL + ['model.tiny_sft_steps=0']!r}); "
            f"got = build(cfg, Path({str(tmp_path)!r}), structlog.get_logger('t')); "
            "print(len(got.train_items), 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    n, torch_in, transformers_in = out.stdout.splitlines()[-1].split()
    assert int(n) > 0 and (torch_in, transformers_in) == ("False", "False"), out.stdout
