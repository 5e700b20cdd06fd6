"""The tiny recipe end to end on CPU: real Redis, Ray, SQLite, transformers and DeepSpeed."""
import json
import statistics
import subprocess
import sys

import pytest

OUTCOMES = ("trained", "filtered", "stale", "gold_failed", "failed")


def run_tiny(tmp_path, run_id: str, *overrides: str, steps: int = 3, sft_steps: int = 20) -> list[dict]:
    """A tiny run of 8 prompts per step (3 steps after 20 warm-start steps unless told); returns
    its per-step metrics rows."""
    out = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", f"run_root={tmp_path}",
                          f"coordinator.steps={steps}", f"model.tiny_sft_steps={sft_steps}", "coordinator.eval_every=0",
                          "coordinator.checkpoint_every=0", "coordinator.prompts_per_step=8", f"run_id={run_id}",
                          *overrides], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(steps))
    return rows


@pytest.fixture(scope="module")
def fixed_pool_run(tmp_path_factory):
    """Colocated, 14 steps over a fixed pool of 8 training prompts (every step trains on all 8),
    after a warm start that leaves their reward near 0.2. Shared by the tests below."""
    root = tmp_path_factory.mktemp("tiny")
    return root / "e2e", run_tiny(root, "e2e", "data.limit=8", "learner.lr=3e-3", steps=14, sft_steps=25)


def test_tiny_run_accounts_for_every_prompt(fixed_pool_run):
    run_dir, steps = fixed_pool_run
    for r in steps:
        assert r["prompts"] == sum(r.get(f"prompts_{k}", 0) for k in OUTCOMES) == 8, r
    assert (run_dir / "checkpoints" / "latest").exists()


def test_tiny_grpo_raises_the_training_reward(fixed_pool_run):
    """GRPO climbs on prompts it keeps seeing: the mean reward of the last 4 steps is above that of
    the first 3 by a margin that noise does not reach. Measured (last 4 minus first 3): +0.38 for
    this run (deterministic here: three runs gave identical rewards), +0.19, +0.25 and +0.36 with
    generator.seed=1, 2, 3; with learner.lr=1e-12 (no learning) +0.03 and -0.02."""
    rewards = [r["reward_mean"] for r in fixed_pool_run[1]]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-4:])
    assert last > first + 0.1, [round(x, 3) for x in rewards]


def test_tiny_async_mode_with_replacement_prompts_and_broadcast_weight_sync(tmp_path):
    """Async (generation one version ahead) plus top-up of filtered prompts: still one outcome each.
    Weights travel by broadcast in a private group (coordinator.weight_sync=nccl: gloo on CPU),
    the disaggregated combination: the group is built once and every step's sync reaches it."""
    steps = run_tiny(tmp_path, "async", "coordinator.mode=async", "assembler.max_staleness=1",
                     "assembler.replace_filtered=true", "coordinator.weight_sync=nccl")
    for r in steps:
        assert r["prompts"] == sum(r.get(f"prompts_{k}", 0) for k in OUTCOMES) == 8 + r["prompts_replacement"], r
        assert r.get("time_generator_sleep") is None  # async mode never sleeps the engines
    assert any(r["prompts_replacement"] > 0 for r in steps)  # tiny's short warm start leaves groups to replace
    # A sync only completes when the learner and every generator returned its version.
    assert [(r["policy_version"], r["time_weight_sync"] > 0) for r in steps] == [(1, True), (2, True), (3, True)]
    log = [json.loads(line) for line in (tmp_path / "async" / "logs" / "coordinator.jsonl").read_text().splitlines()]
    groups = [e for e in log if e["event"] == "weight-sync group built"]
    assert [(g["backend"], g["world_size"]) for g in groups] == [("gloo", 2)]  # once, for the warm start's sync
