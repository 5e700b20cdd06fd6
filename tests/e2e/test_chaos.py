"""Fault injection, small enough for CI: the short form of `python -m bench.faults.chaos`.

A tiny run with real redis-server (AOF) and Ray loses one generator, one scorer, the assembler
(SIGKILL) and its redis-server; then a second run loses its learner and resumes from its
checkpoint; one launch survives its learner's and coordinator's deaths by relaunching itself, and one
whose learner dies before any checkpoint starts again from the beginning. Nothing may be lost or trained
twice, and nothing may be left running.
The full 20+ kill figures are in docs/reliability/faults.md.
"""
from __future__ import annotations

from bench.faults.chaos import phase_resume, phase_workers


def test_worker_and_redis_kills_lose_nothing(tmp_path):
    r = phase_workers(tmp_path, kills=3, steps=10, sft=10, per_step=8, seed=1, redis_kills=1, gap=(0.1, 0.6))
    assert r["rc"] == 0, r
    assert len(r["injected"]) == 4 and {k["kind"] for k in r["injected"]} == {"generator", "scorer", "assembler",
                                                                                "redis"}, r["injected"]
    assert r["steps_completed"] == 10 and r["prompts"] == 10 * 8
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert r["leftovers"] == []


def test_learner_kill_resumes_at_the_next_step(tmp_path):
    r = phase_resume(tmp_path, steps=5, sft=10, per_step=8, seed=1, victims=("learner",))
    assert r["rc"][0] == 2 and r["rc"][-1] == 0, r
    assert "error: " in r["errors"][0] and "\n" not in r["errors"][0]
    assert r["resume_ok"] and r.get("cursor_ok"), r["injected"]
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert r["leftovers"] == []


def test_learner_and_coordinator_deaths_are_resumed_by_the_launcher_itself(tmp_path):
    """cluster.max_relaunches: one launch survives its learner's and then its coordinator's SIGKILL,
    each time restarting every actor from the latest checkpoint at the right step and data position.
    The fixed pool of 8 prompts after 25 warm-start steps: most groups train, so a step trained
    twice would show (as "doubled")."""
    r = phase_resume(tmp_path, steps=8, sft=25, per_step=8, seed=1, victims=("learner", "coordinator"), auto=True,
                     extra=("data.limit=8",))
    assert r["rc"] == [0] and [k["kind"] for k in r["injected"]] == ["learner", "coordinator"], r
    assert r["trained"] >= 32, r  # of 64
    assert r["resume_ok"] and r.get("cursor_ok"), r["injected"]
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert r["leftovers"] == []


def test_a_learner_death_before_the_first_checkpoint_starts_the_run_again(tmp_path):
    """No checkpoint yet (coordinator.checkpoint_every=0: only the final one): the launcher relaunches
    the run from its start instead of failing, and the run ends with every prompt accounted once."""
    r = phase_resume(tmp_path, steps=5, sft=25, per_step=8, seed=2, victims=("learner",), auto=True,
                     extra=("data.limit=8", "coordinator.checkpoint_every=0"))
    assert r["rc"] == [0] and [k["kind"] for k in r["injected"]] == ["learner"], r
    assert r["injected"][0]["checkpoint_step"] == -1 and r["resume_ok"], r["injected"]
    assert r["trained"] >= 16, r  # of 40: a step trained twice would show as doubled
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert r.get("cursor_ok") and r["leftovers"] == []
