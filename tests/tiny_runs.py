"""Whole tiny runs for the end-to-end tests: `run_tiny` launches `python -m launch.cluster tiny` as a user would
and checks what every orderly run must show; `check_two_rank_run` checks a run of two learner ranks.

Invariant: nothing here starts anything but the one launcher process per `run_tiny` call (bounded: 600 s),
and every check is an assertion naming what it saw.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

OUTCOMES = ("trained", "filtered", "stale", "gold_failed", "failed")


def run_tiny(tmp_path, run_id: str, *overrides: str, steps: int = 3, sft_steps: int = 20) -> list[dict]:
    """A tiny run of 8 prompts per step (3 steps after 20 warm-start steps unless told); returns
    its per-step metrics rows."""
    out = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", f"run_root={tmp_path}",
                          f"coordinator.steps={steps}", f"model.tiny_sft_steps={sft_steps}", "coordinator.eval_every=0",
                          "coordinator.checkpoint_every=0", "coordinator.prompts_per_step=8", f"run_id={run_id}",
                          *overrides], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # An orderly end: the consumers' loops returned on their own, every actor was killed for good and
    # none is left; Ray printed no "(raylet) Task ... failed ... The actor was restarted" (what removing
    # the placement groups under live restartable actors caused on the H200).
    assert "(raylet)" not in out.stdout + out.stderr and "was restarted" not in out.stdout + out.stderr
    events = [json.loads(line) for line in (tmp_path / run_id / "logs" / "launcher.jsonl").read_text().splitlines()]
    stopped = [e for e in events if e["event"] == "actors stopped"]
    assert len(stopped) == 1 and stopped[0]["alive"] == 0 and "error" not in stopped[0], stopped
    assert stopped[0]["loops_drained"] == stopped[0]["loops"] >= 2 and stopped[0]["killed"] >= 5, stopped
    # The launcher lives as long as the run: its inputs (model, tokenizer, prompts, warm-start draws) were
    # built in a child process (launch/inputs.py), so torch and transformers never entered it.
    finished = [e for e in events if e["event"] == "run finished"]
    assert len(finished) == 1 and finished[0]["launcher_torch"] == 0 == finished[0]["launcher_transformers"], finished
    rows = [json.loads(line) for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(steps))
    return rows


def check_two_rank_run(run_dir: Path, steps: list[dict]) -> None:
    """A run of learner.num_ranks=2: every trained step was trained once with as many groups as the
    ledger says, and both ranks logged a world of 2 (also used by tests/e2e/test_tiny_e2e.py's async run,
    ZeRO-3 with a broadcast weight sync)."""
    trained = sum(int(r.get("prompts_trained", 0)) for r in steps)
    assert trained > 0
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert json.loads((latest / "learner" / "learner_world.json").read_text())["world_size"] == 2
    counts = json.loads((latest / "learner" / "train_counts.json").read_text())
    assert all(times == 1 for times, _ in counts.values()), counts  # nothing doubled
    assert sum(groups for _, groups in counts.values()) == trained, counts  # nothing lost
    for rank in (0, 1):
        ready = [json.loads(line) for line in (run_dir / "logs" / f"learner-{rank}.jsonl").read_text().splitlines()]
        assert [e["world_size"] for e in ready if e["event"] == "learner.ready"] == [2]
