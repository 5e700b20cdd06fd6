"""A SMOKE run of bench/peers: our side always (the launcher's warm-start export, our run from it, launch.eval); the
TRL side only when its venv can be had without the network (bench/peers/venv.py, offline: the machine's local
package sources, or a venv already built), and its test skips, saying why, otherwise."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers.venv import PeerVenvUnavailable, ensure_venv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One SMOKE run of `python -m bench.peers`: both sides when the peer venv can be had offline."""
    try:
        ensure_venv(offline=True, log=lambda m: None)
        sides, why = "ours trl", ""
    except PeerVenvUnavailable as e:
        sides, why = "ours", f"no peer venv without the network: {e}"
    out = tmp_path_factory.mktemp("peers")
    env = dict(os.environ, SMOKE="1", OUT=str(out), SIDES=sides, PEERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "bench.peers"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "peers.json").read_text()), p.stdout, why


@pytest.mark.slow
def test_smoke_our_side_measures_and_evaluates_from_the_shared_export(smoke):
    result, stdout, _ = smoke
    row = result["rows"][0]
    assert row["rc"] == 0 and row["steps"] == result["steps"] == 3
    assert 0 < row["first_step_s"] < row["wall_s"] and row["s_per_step_median"] > 0
    assert row["peak_rss_gb"] > 0.3 and row["peak_processes"] > 5  # launcher, Ray, redis-server, actors
    assert 0.0 <= row["ex_greedy"] <= 1.0 and 0.0 <= row["sampled_reward"] <= 1.0 and row["eval_questions"] == 8
    marks = [m["what"] for m in row["startup"]]
    assert "Redis + Ray start (ray.init)" in marks and marks[-1] == "first step done"
    assert "time_generation" in row["per_step"] and "time_training" in row["per_step"]
    assert "warm start done" in [m["what"] for m in result["export"]["startup"]]
    assert stdout.startswith("| | samples/s end to end |") and "Setup differences that remain:" in stdout


@pytest.mark.slow
def test_smoke_trl_side_trains_from_the_same_export(smoke):
    result, stdout, why = smoke
    if why:
        pytest.skip(why)
    peer = result["peer"]
    assert peer["rc"] == 0 and peer["steps"] == 3 and peer["first_step_s"] > 0
    assert peer["meta"]["prompts"] == 3 * 16 and peer["meta"]["prompt_ids_mismatched"] == 0
    assert 0.0 <= peer["ex_greedy"] <= 1.0 and peer["eval_questions"] == 8
    assert "GRPOTrainer" in stdout and " against TRL" in stdout

