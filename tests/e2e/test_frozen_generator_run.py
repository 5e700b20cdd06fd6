"""A generator frozen (SIGSTOP) in the middle of a whole tiny run is restarted in place, and the run ends whole."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from config import apply_overrides
from config.recipes import get_recipe


def _cfg(*overrides: str):
    return apply_overrides(get_recipe("tiny"), ["coordinator.call_timeout_s=0.5", "generator.pause_timeout_s=0.25",
                                                "coordinator.step_timeout_s=2", *overrides])


@pytest.mark.slow  # a whole tiny run (~3-5 min on 2 busy cores)
def test_a_generator_frozen_mid_run_is_restarted_in_place_and_the_run_ends_whole(tmp_path):
    """`tiny` (one generator, colocated) with small bounds: the generator is SIGSTOPped mid-run (alive to
    Ray, silent: Ray restarts nothing by itself). Its prompts are late (step_timeout_s), so the coordinator
    asks every generator (health), which runs past coordinator.call_timeout_s; it kills the frozen one, Ray
    restarts it in place, the call is made again, and the step waits once more for its prompts, which the
    new instance (resynced) serves: the step ends well within step_timeout_s of the restart with no prompt
    failed (23 s at load ~60, most of it the new instance's start and engine build; before: its collect
    waited step_timeout_s again and failed the 7 prompts the frozen instance held, 74 s after the restart),
    and the run goes on without a relaunch, ending 0 with nothing lost or trained twice and no process left."""
    from bench.faults.chaos import _common, _wait_rows, rows, verify
    from bench.faults.procs import Launch, find_pids

    # call_timeout_s: above the slowest healthy call of tiny on a machine at load ~30 (a checkpoint save,
    # a few seconds idle); step_timeout_s: above its slowest healthy generation (8 prompts: 1-3 s at
    # load ~20), and what the frozen step waits before the sleep call that names the generator.
    steps, per_step, call_s, pause_s, step_s = 6, 8, 30, 5, 45
    run_id = "frozen-generator"
    run_dir, log = tmp_path / run_id, tmp_path / "launch.log"
    launch = Launch(_common(tmp_path, run_id, steps, 25, per_step) + [
        "data.limit=8", "coordinator.checkpoint_every=2", "cluster.max_relaunches=1",
        f"coordinator.call_timeout_s={call_s}", f"generator.pause_timeout_s={pause_s}",
        f"coordinator.step_timeout_s={step_s}"], log)
    pid = 0
    try:
        assert _wait_rows(run_dir, launch, 3, 900), log.read_text()[-3000:]
        pid = find_pids(launch.proc.pid, "generator")[0]
        os.kill(pid, signal.SIGSTOP)
        guard = step_s + call_s + pause_s + 120  # + a relaunch's teardown on a busy machine
        coord_log = run_dir / "logs" / "coordinator.jsonl"
        deadline = time.monotonic() + guard
        while "restarted in place" not in (coord_log.read_text(errors="replace") if coord_log.exists() else ""):
            assert time.monotonic() < deadline and launch.proc.poll() is None, \
                f"no restart in place within {guard} s of the generator's SIGSTOP: {log.read_text()[-3000:]}"
            time.sleep(2)
        rc = launch.wait(900)
    finally:
        if launch.proc.poll() is None:
            launch.wait(0)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    relaunches = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("relaunching from")]
    assert rc == 0 and relaunches == [], log.read_text()[-3000:]
    restarts = [ln for ln in coord_log.read_text(errors="replace").splitlines() if "restarted in place" in ln]
    assert len(restarts) == 1 and '"generator": "generator-0"' in restarts[0] and "did not return within" in restarts[0], restarts
    assert [r["step"] for r in rows(run_dir) if r.get("prompts_failed")] == [], "prompts failed though the generator came back"
    after = _seconds_to_next_step(coord_log, "restarted in place")
    assert after < step_s * 2 / 3, f"the frozen step ended {after:.1f} s after the restart (step_timeout_s={step_s})"
    r = verify(run_dir, steps, per_step)
    assert (r["lost"], r["doubled"], r["bad_rows"]) == (0, 0, 0), r["problems"]
    assert pid not in launch.leftovers() and launch.leftovers() == []


def _seconds_to_next_step(coord_log, marker: str) -> float:
    """Seconds from the coordinator's log line holding `marker` to its next step line (their timestamps)."""
    import json
    from datetime import datetime

    lines = [json.loads(ln) for ln in coord_log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    at = next(i for i, ln in enumerate(lines) if marker in ln.get("event", ""))
    end = next(ln for ln in lines[at:] if ln.get("event") == "step")
    stamp = lambda ln: datetime.fromisoformat(ln["timestamp"].replace("Z", "+00:00"))  # noqa: E731
    return (stamp(end) - stamp(lines[at])).total_seconds()

