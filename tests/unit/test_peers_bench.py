"""bench/peers: the table, the process-tree sampler, the profile readers, and a SMOKE run of the bench.

The SMOKE run (slow) always runs our side (the launcher's warm-start export, our run from it, launch.eval);
the TRL side runs only when its venv can be had without the network (bench/peers/venv.py, offline: the
machine's local package sources, or a venv already built), and its test skips, saying why, otherwise.
"""
import json
from pathlib import Path

import pytest

from bench.peers import ours, table
from bench.peers.venv import usable

REPO = Path(__file__).resolve().parents[2]


def test_table_prints_every_side_the_ratios_and_the_differences():
    ours_row = {"name": "ours", "samples_per_s_e2e": 60.0, "samples_per_s_step": 100.0, "first_step_s": 40.0,
                "s_per_step_median": 1.28, "wall_s": 128.0, "ex_greedy": 0.5, "ex_greedy_strict": 0.48,
                "sampled_reward": 0.41, "peak_rss_gb": 2.5, "peak_pss_gb": 1.5, "peak_processes": 27}
    peer = {"name": "TRL", "samples_per_s_e2e": 40.0, "samples_per_s_step": 80.0, "first_step_s": 20.0,
            "s_per_step_median": 1.6, "wall_s": 192.0, "ex_greedy": None, "sampled_reward": 0.4, "peak_rss_gb": 1.0,
            "peak_pss_gb": 1.0, "peak_processes": 2}
    text = table.report([ours_row], peer, ["one difference", "another"])
    lines = text.splitlines()
    assert lines[0].startswith("| | samples/s end to end |") and lines[1].startswith("| --- |")
    assert lines[2] == "| ours | 60.0 | 100.0 | 40.0 | - | 1.28 | 128 | 0.500 | 0.480 | 0.410 | 2.50 (27 proc.) | 1.50 |"
    assert lines[3].startswith("| TRL | 40.0 |") and "| - |" in lines[3]  # a missing number is "-", never 0
    assert "samples/s end to end 1.50x, per step 1.25x, peak memory 2.50x (RSS), 1.50x (PSS)" in text
    assert text.endswith("- one difference\n- another")


def test_over_seeds_means_each_side_with_its_range_and_the_ratio_of_the_means():
    def row(name, sps, mem, ex):
        return {"name": name, "samples_per_s_e2e": sps, "peak_rss_gb": mem, "ex_greedy": ex, "sampled_reward": None}
    runs = [{"seed": s, "rows": [row(f"ours (seed {s})", sps, 2.0, ex)], "peer": row(f"TRL (seed {s})", 10.0, 1.0, 0.5)}
            for s, sps, ex in ((0, 20.0, 0.4), (1, 30.0, 0.6))]
    text = table.over_seeds(runs)
    lines = text.splitlines()
    assert lines[2].startswith("| ours (2 seeds) | 25.0 (20.0-30.0) | - |") and "| 0.500 (0.400-0.600) |" in lines[2]
    assert lines[3].startswith("| TRL (2 seeds) | 10.0 (10.0-10.0) |")
    assert "samples/s end to end 2.50x" in text and "peak memory 2.00x (RSS)" in text


def test_timeline_from_step_end_times():
    t = ours.timeline([110.0, 111.0, 113.0, 114.0], start=100.0, samples_per_step=128)
    assert t["first_step_s"] == 10.0 and t["steps"] == 4.0
    assert t["s_per_step_median"] == 1.0 and t["samples_per_s_step"] == 128.0
    assert t["samples_per_s_loop"] == pytest.approx(128 * 3 / 4.0)
    assert ours.timeline([], 0.0, 128) == {}


def test_the_end_is_the_command_after_its_last_step():
    from bench.peers.__main__ import after_last_step

    class Tree:
        start, wall_s = 100.0, 30.0

    row = ours.timeline([110.0, 111.0, 113.0, 129.0], start=100.0, samples_per_step=128)
    assert after_last_step(Tree, row) == {"after_last_step_s": pytest.approx(1.0)}
    assert after_last_step(Tree, {}) == {}


def test_step_profile_separates_the_step_from_what_lies_between_steps():
    rows = [{"step": -1, "time": 5.0, "time_eval": 3.0},
            {"step": 0, "time": 10.0, "time_step": 2.0, "time_generation": 1.5},
            {"step": 1, "time": 13.0, "time_step": 2.0, "time_generation": 1.0, "time_eval": 0.8}]
    p = ours.step_profile(rows)
    assert p["time_generation"] == {"median": 1.25, "total": 2.5, "n": 2.0}
    assert p["time_eval"]["n"] == 1.0  # the initial eval (step -1) is start-up, not a step
    assert p["between_steps"]["total"] == pytest.approx(1.0)


def test_startup_profile_orders_log_marks_and_processes(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "launcher.jsonl").write_text(
        json.dumps({"event": "prompts", "timestamp": "2026-12-04T15:00:05Z"}) + "\n"
        + json.dumps({"event": "run started", "timestamp": "2026-12-04T15:00:20Z"}) + "\n")
    (logs / "coordinator.jsonl").write_text(
        "not json\n" + json.dumps({"event": "step", "step": 0, "timestamp": "2026-12-04T15:00:50Z"}) + "\n")
    start = ours._ts("2026-12-04T15:00:00Z")
    marks = ours.startup_profile(tmp_path, start, [(0.1, 1, "python launch.cluster"), (7.5, 2, "gcs_server")])
    assert [(m["at_s"], m["gap_s"]) for m in marks] == [(5.0, 5.0), (7.5, 2.5), (20.0, 12.5), (50.0, 30.0)]
    assert marks[-1]["what"] == "first step done"


def test_venv_is_usable_only_with_the_pinned_torch():
    got = {"trl": "1.16.0", "torch": "2.13.0+cpu", "transformers": "5.25.0", "datasets": "5.2.0"}
    assert usable(got, "5.25.0") and usable(got, None)
    assert not usable(got, "5.18.0")  # an online build pins the project's transformers
    assert not usable({**got, "torch": "2.11.0"}, None) and not usable(None, None)


# -- the SMOKE run of the bench ------------------------------------------------------------------


