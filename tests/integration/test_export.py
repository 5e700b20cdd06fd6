"""HF exports and checkpoint pruning: the pruning policy, atomic commits, and the coordinator's
save_checkpoint over a real CPU learner (an export reproduces the learner's log-probs in plain
transformers; after pruning, a fresh learner resumes from what is left with the same weights)."""
import asyncio
import json

import pytest
import torch

from launch.export import (
    ExportError,
    begin_export,
    checkpoints_to_prune,
    commit_export,
    export_dir,
    latest_export,
    prune_checkpoints,
    read_settings,
)

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


def test_pruning_keeps_the_newest_and_always_the_latest():
    names = [f"step_{i:06d}" for i in (4, 9, 14, 19)] + ["latest", "step_x", "notes"]
    assert checkpoints_to_prune(names, keep=2, latest="step_000019") == ["step_000004", "step_000009"]
    # the marker still names an older one (a crash between writing a checkpoint and its marker): kept
    assert checkpoints_to_prune(names, keep=1, latest="step_000009") == ["step_000004", "step_000014"]
    assert checkpoints_to_prune(names, keep=0, latest=None) == []
    assert checkpoints_to_prune(names[:2], keep=3, latest="step_000009") == []
    with pytest.raises(ValueError, match="keep must be >= 0"):
        checkpoints_to_prune(names, keep=-1, latest=None)


def test_prune_without_a_latest_marker_deletes_nothing(tmp_path):
    for i in range(4):
        (tmp_path / f"step_{i:06d}").mkdir()
    assert prune_checkpoints(tmp_path, keep=1) == []
    (tmp_path / "latest").write_text("step_000002")
    assert sorted(p.name for p in prune_checkpoints(tmp_path, keep=1)) == ["step_000000", "step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_an_export_is_complete_or_absent(tmp_path):
    final = export_dir(tmp_path, 5)
    tmp = begin_export(final)
    (tmp / "model.safetensors").write_bytes(b"half")
    with pytest.raises(ExportError, match="no config.json"):  # the writer died before config.json
        commit_export(tmp, final, {})
    assert not final.exists() and latest_export(tmp_path) is None
    tmp = begin_export(final)  # the next attempt starts clean
    assert list(tmp.iterdir()) == []
    (tmp / "config.json").write_text("{}")
    source = tmp_path / "src"
    source.mkdir()
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "model.safetensors").write_bytes(b"not copied")
    commit_export(tmp, final, {"prompt_style": "compact"}, source)
    assert sorted(p.name for p in final.iterdir()) == ["arctic_rl.json", "chat_template.jinja", "config.json"]
    assert read_settings(final)["prompt_style"] == "compact" and read_settings(final)["max_tokens"] == 4096
    tmp = begin_export(final)  # a re-export replaces the old directory only once complete
    (tmp / "config.json").write_text('{"v": 2}')
    commit_export(tmp, final, {})
    assert json.loads((final / "config.json").read_text()) == {"v": 2}
    assert latest_export(tmp_path) == final and sorted(p.name for p in final.parent.iterdir()) == ["step_5"]


# Trains 5 checkpointed steps with keep_checkpoints=2 over a real LearnerShell, then SIGKILLs itself.
_TRAIN_THEN_DIE = """
import asyncio, os, signal, sys
from actors.coordinator.coordinator import Coordinator
from actors.learner.shell import LearnerShell
from config import RunContext, apply_overrides
from config.recipes import tiny
from tasks.tiny_model import build_tiny

cfg = apply_overrides(tiny(), [])
cfg.coordinator.keep_checkpoints = 2
cfg.coordinator.keep_exports = 3
run_dir = sys.argv[1]
model_dir = build_tiny(run_dir + "/model", model_cfg=cfg.model, seed=0)
learner = LearnerShell(cfg.learner, model_cfg=cfg.model, model_path=model_dir, total_steps=10,
                       micro_batch_tokens=cfg.assembler.micro_batch_tokens)
coord = Coordinator(cfg, RunContext(run_id="exp", run_dir=run_dir), [], [], generators=[], learner=learner, assembler=None)
for step in range(5):
    learner.sft_step([([5, 6, 7, 8, 9, 10], [11, 12, 13])], 1e-2)
    coord.version = step + 1
    asyncio.run(coord.save_checkpoint(step))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_checkpoints_export_prune_then_kill_and_resume(tmp_path):
    """A process checkpoints 5 steps (keep_checkpoints=2, keep_exports=3) and is SIGKILLed; a fresh learner resumes
    from what pruning left, and the last export, loaded by plain transformers, gives its log-probs."""
    import os
    import signal
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from actors.coordinator.checkpoint import Checkpoints
    from actors.coordinator.coordinator import Coordinator
    from actors.learner.shell import LearnerShell
    from config import RunContext, apply_overrides
    from config.recipes import tiny

    run_dir = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _TRAIN_THEN_DIE, str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000003", "step_000004"]
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == [f"step_{n}" for n in range(3, 6)]  # keep_exports=3
    export = latest_export(run_dir)
    assert export.name == "step_5" and read_settings(export)["prompt_style"] == "compact"
    assert (export / "tokenizer.json").is_file() and (export / "generation_config.json").is_file()

    cfg = apply_overrides(tiny(), [])
    fresh = LearnerShell(cfg.learner, model_cfg=cfg.model, model_path=str(run_dir / "model"), total_steps=10,
                         micro_batch_tokens=cfg.assembler.micro_batch_tokens)
    resumed = Coordinator(cfg, RunContext(run_id="exp", run_dir=str(run_dir)), [], [], generators=[], learner=fresh,
                          assembler=None)

    async def no_generators_to_sync(version, targets=None, attempts=5):  # no generators here (and no Ray for the object store)
        return 0.0

    resumed.weights.sync = no_generators_to_sync
    latest = Checkpoints.latest(run_dir)
    assert latest.name == "step_000004"
    asyncio.run(resumed.resume_from(latest))
    assert resumed.step == 5 and resumed.version == 5

    # The export of the killed run, loaded by plain transformers, gives the resumed learner's log-probs.
    pair = ([5, 6, 7, 8, 9, 10], [11, 12, 13])
    expected = fresh.learner.logprobs([pair])[0]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([pair[0] + pair[1]])).logits[0, len(pair[0]) - 1: -1]
    logits = logits.float() / fresh.learner.temperature
    got = torch.log_softmax(logits, -1).gather(1, torch.tensor(pair[1])[:, None]).squeeze(1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    exported = dict(model.named_parameters())
    for name, tensor in fresh.learner.state_dict_hf().items():
        torch.testing.assert_close(exported[name].detach(), tensor, atol=0, rtol=0)


def test_an_export_records_its_episode_shape_and_eval_and_serve_run_it_as_trained(tmp_path):
    """A multi-turn run's export carries generator.max_turns and max_observation_tokens: `launch.eval`
    without --max-turns runs the episodes as trained, and the engine cuts observations as in training
    (before, eval cut them at the default 128 tokens: tiny_mt seed 0 scored 0.068 instead of the run's 0.311)."""
    from config import apply_overrides
    from config.recipes import get_recipe
    from launch.export import inference_settings

    mt = inference_settings(apply_overrides(get_recipe("tiny_mt"), []))
    assert (mt["max_turns"], mt["max_observation_tokens"]) == (3, 32)
    one = inference_settings(apply_overrides(get_recipe("tiny"), []))
    assert one["max_turns"] == 1
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    assert (read_settings(old)["max_turns"], read_settings(old)["max_observation_tokens"]) == (1, 128)


def test_a_checkpoint_becomes_the_resume_point_only_after_what_the_caller_writes_before_it(tmp_path):
    """The coordinator writes a step's metrics row in `before_latest`: a death right after the `latest` marker must
    never resume past a step whose row was not written (a soak's coordinator killed there lost step 54's row)."""
    from actors.coordinator.checkpoint import Checkpoints
    from actors.coordinator.coordinator import Coordinator
    from actors.learner.shell import LearnerShell
    from config import RunContext, apply_overrides
    from config.recipes import tiny
    from tasks.tiny_model import build_tiny

    cfg = apply_overrides(tiny(), [])
    run_dir = tmp_path / "run"
    model_dir = build_tiny(run_dir / "model", model_cfg=cfg.model, seed=0)
    learner = LearnerShell(cfg.learner, model_cfg=cfg.model, model_path=str(model_dir), total_steps=10,
                           micro_batch_tokens=cfg.assembler.micro_batch_tokens)
    coord = Coordinator(cfg, RunContext(run_id="row", run_dir=str(run_dir)), [], [], generators=[], learner=learner,
                        assembler=None)
    asyncio.run(coord.save_checkpoint(0))
    seen = []

    def before_latest():
        seen.append((Checkpoints.latest(run_dir).name, (run_dir / "hf" / "step_2").is_dir()))

    asyncio.run(coord.save_checkpoint(1, before_latest=before_latest))
    assert seen == [("step_000000", True)]  # the export is in place, the previous checkpoint still the resume point
    assert Checkpoints.latest(run_dir).name == "step_000001"
