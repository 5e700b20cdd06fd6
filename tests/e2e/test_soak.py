"""The soak's CI form: `python -m bench.faults.soak` for SOAK_MINUTES (default 2) instead of an hour.

Both halves (colocated; async with 2 learner ranks), a fault every ~15 s drawn from every kind the full
soak draws (SIGKILL of a generator, a scorer, the assembler, a learner rank, the coordinator; Redis
killed and restarted from its AOF; a burst of hostile SQL and an undecodable entry in the rollouts
stream), real redis-server, Ray, actors and launcher. Nothing may be lost, trained twice or hang, every
fault must be recovered from, each half must stop on SIGTERM through the launcher's own teardown
(exit 130) and leave no process. The hour's figures are in docs/reliability/soak.md.
"""
from __future__ import annotations

import json
import os

import pytest

from bench.faults import rss, soak


@pytest.mark.slow  # two whole tiny runs under faults
def test_a_short_soak_loses_doubles_and_hangs_nothing(tmp_path):
    minutes = float(os.environ.get("SOAK_MINUTES", 2))
    out = tmp_path / "soak.json"
    rc = soak.main(["--minutes", str(minutes), "--fault-every", "15", "--sft-steps", "25", "--prompts-per-step", "8",
                    "--override", "data.limit=8",
                    "--eval-every", "5", "--seed", "7", "--run-root", str(tmp_path), "--json", str(out)])
    report = json.loads(out.read_text())
    s, halves = report["summary"], report["halves"]
    assert [h["half"] for h in halves] == ["colocated", "async"]
    # seed 7 draws hostile, redis, assembler and coordinator first; how many come up depends on the
    # machine (a relaunch took 15-120 s), at least one in each half
    assert all(h["injected"] for h in halves) and s["faults"] >= 2, s["by_kind"]
    assert (s["lost"], s["doubled"], s["hangs"], s["bad_rows"], s["unrecovered"]) == (0, 0, 0, 0, 0), \
        (s, [h.get("problems") for h in halves])
    assert s["errors"] == [] and s["leftovers"] == []
    assert [h["rc"] for h in halves] == [130, 130], [h.get("rc") for h in halves]
    assert all(h["steps_completed"] >= 5 for h in halves), [h.get("steps_completed") for h in halves]
    assert sum(h["trained"] for h in halves) >= 16  # groups did train: a step trained twice would show
    for h in halves:  # the run's streams are trimmed: nothing left but what is in flight
        assert h["redis"]["streams"] and all(v["length"] <= 256 for v in h["redis"]["streams"].values()), h["redis"]
    assert rc == 0


def test_the_rss_log_names_each_actor_by_its_class_and_role_and_samples_the_launcher_itself():
    assert rss._name("ray::LearnerShell.train_from_stream") == "ray::LearnerShell"
    assert rss._name("ray::soak-async:relaunch2:learner-1:LearnerShell.sleep") == "ray::LearnerShell (learner-1)"
    assert rss._name("/x/.venv/bin/python -m launch.cluster tiny run_id=a") == "python -m launch.cluster"
    log = rss.RssLog(warm_s=0.0)
    log.sample(os.getpid(), now=10.0, warm_after=0.0)  # this process stands in for the launcher (the tree's root)
    log.sample(os.getpid(), now=30.0, warm_after=0.0)
    mine = log.procs[os.getpid()]
    assert mine["start_kb"] > 0 and mine["end_t"] == 30.0
    assert os.getpid() in [p["pid"] for p in log.report(end_t=30.0, min_life_s=10.0)]
