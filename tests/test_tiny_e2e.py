"""The tiny recipe end to end on CPU: real Redis, Ray, SQLite, transformers and DeepSpeed."""
import json
import subprocess
import sys

OUTCOMES = ("trained", "filtered", "stale", "gold_failed", "failed")


def run_tiny(tmp_path, run_id: str, *overrides: str) -> list[dict]:
    """A 3-step tiny run of 8 prompts per step; returns its per-step metrics rows."""
    out = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", f"run_root={tmp_path}", "coordinator.steps=3",
                          "model.tiny_sft_steps=20", "coordinator.eval_every=0", "coordinator.checkpoint_every=0",
                          "coordinator.prompts_per_step=8", f"run_id={run_id}", *overrides],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2]
    return steps


def test_tiny_run_accounts_for_every_prompt(tmp_path):
    for r in run_tiny(tmp_path, "e2e"):
        assert r["prompts"] == sum(r.get(f"prompts_{k}", 0) for k in OUTCOMES) == 8, r
    assert (tmp_path / "e2e" / "checkpoints" / "latest").exists()


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
