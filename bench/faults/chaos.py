"""Fault injection on the tiny recipe: real redis-server, real Ray, real actors, SIGKILL.

    python -m bench.faults.chaos                      # >= 21 worker kills + 1 Redis kill, then learner
                                               # and coordinator kills with resume; prints the table
    python -m bench.faults.chaos --kills 3 --steps 8  # a short version (what tests/e2e/test_chaos.py runs)

Phase "workers": one run with cluster.redis_persistence=true. While steps run, SIGKILLs a
generator, a scorer or the assembler process (found by Ray's process title among the
launcher's descendants) at random points, and once the embedded redis-server; Ray restarts
the actor, its pending messages are reclaimed, the step completes.
Phase "resume": a run whose learner, then coordinator, is SIGKILLed; each time the launcher
(cluster.max_relaunches=0) exits with one `error:` line and a fresh launch with run_id=<same>
coordinator.resume=true continues from the last checkpoint.
Phase "autoresume": the same kills in one launch with cluster.max_relaunches=2: the launcher
itself tears the run's actors down and starts them again from the last checkpoint.

After each phase, from the final checkpoint (the coordinator's ledger, the learner's per-step
train counts) and metrics.jsonl:
  lost    = prompts of a step with no outcome, or marked trained but not in the learner's batch
  doubled = prompts trained more than once (a step trained twice, or more groups than trained)
and per step: prompts == trained + filtered + stale + gold_failed + failed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

from bench.faults.procs import ROOT, Launch, find_pids
from bench.outputs import work_dir
from queues.messages import is_eval_task, task_step

OUTCOMES = ("trained", "filtered", "stale", "gold_failed", "failed")


# -- reading a run ---------------------------------------------------------------------------

def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return [r for r in out if r.get("step", -1) >= 0]


def _wait_rows(run_dir: Path, launch: Launch, n: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.proc.poll() is None:
        launch.watch()
        if len(rows(run_dir)) >= n:
            return True
        time.sleep(0.1)
    return len(rows(run_dir)) >= n


def step_seconds(run_dir: Path, default: float = 1.0) -> float:
    """The median `time_step` of the run's rows so far (the workers phase's baseline measure; `default` before one)."""
    steps = [float(r["time_step"]) for r in rows(run_dir) if r.get("time_step")]
    return statistics.median(steps) if steps else default


def _wait_log(log_path: Path, text: str, count: int, launch: Launch, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.proc.poll() is None:
        launch.watch()
        if log_path.read_text(errors="replace").count(text) >= count:
            return True
        time.sleep(0.1)
    return False


def verify(run_dir: Path, steps: int, per_step: int) -> dict:
    """Lost and doubled prompts over the whole run, from the final checkpoint and metrics."""
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ck = run_dir / "checkpoints" / latest
    state = json.loads((ck / "coordinator.json").read_text())
    ledger: dict[str, str] = state["ledger"]
    counts = {int(k): v for k, v in json.loads((ck / "learner" / "train_counts.json").read_text()).items()}
    last_row = {}
    for r in rows(run_dir):
        last_row[int(r["step"])] = r  # a step redone after a resume: its last attempt counts
    lost = doubled = failed = bad_rows = 0
    problems = []
    for step in range(steps):
        mine = {t: o for t, o in ledger.items() if not is_eval_task(t) and task_step(t) == step}
        if len(mine) < per_step:
            lost += per_step - len(mine)
            problems.append(f"step {step}: {per_step - len(mine)} prompts have no outcome")
        unknown = [t for t, o in mine.items() if o not in OUTCOMES]
        lost += len(unknown)
        failed += sum(o == "failed" for o in mine.values())
        trained = sum(o == "trained" for o in mine.values())
        times, groups = counts.get(step, [0, 0])
        if trained:
            if times == 0:
                lost += trained
                problems.append(f"step {step}: {trained} marked trained, learner never trained the step")
            else:
                doubled += (times - 1) * trained + max(0, groups - times * trained)
                lost += max(0, trained - groups // max(1, times))
        elif times:
            doubled += groups
            problems.append(f"step {step}: learner trained {groups} groups nobody marked trained")
        row = last_row.get(step)
        if row is None:
            bad_rows += 1
            problems.append(f"step {step}: no metrics row")
        else:
            parts = sum(row.get(f"prompts_{o}", 0) for o in OUTCOMES)
            if int(row["prompts"]) != per_step or int(parts) != per_step or int(row.get("prompts_trained", 0)) != trained:
                bad_rows += 1
                problems.append(f"step {step}: metrics prompts={row['prompts']} parts={parts} "
                                f"trained={row.get('prompts_trained')} ledger trained={trained}")
    return {"steps_completed": state["step"] + 1, "prompts": len(ledger), "lost": lost, "doubled": doubled,
            "failed": failed, "bad_rows": bad_rows, "problems": problems, "cursor": state["cursor"],
            "resyncs": state.get("resyncs", 0), "trained": sum(o == "trained" for o in ledger.values())}


def _common(run_root: Path, run_id: str, steps: int, sft: int, per_step: int) -> list[str]:
    return [f"run_root={run_root}", f"run_id={run_id}", f"coordinator.steps={steps}",
            f"coordinator.prompts_per_step={per_step}", f"model.tiny_sft_steps={sft}", "coordinator.eval_every=0",
            "cluster.redis_persistence=true", "cluster.reclaim_idle_s=2", "logging.console=false"]


def _recovery(run_dir: Path, kill_wall: float, timeout: float, launch: Launch) -> float | None:
    """Seconds from a kill to the end of the first step that completes after it."""
    deadline = time.monotonic() + timeout
    n = len(rows(run_dir))
    while time.monotonic() < deadline:
        launch.watch()
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(rows(run_dir)) > n:
            return time.time() - kill_wall
        if launch.proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


# -- phases ----------------------------------------------------------------------------------

def phase_workers(run_root: Path, kills: int, steps: int, sft: int, per_step: int, seed: int,
                  redis_kills: int = 1, gap: tuple[float, float] = (0.2, 2.0)) -> dict:
    rng = random.Random(seed)
    run_id = f"chaos-workers-{seed}"
    run_dir = run_root / run_id
    kinds = [("generator", "scorer", "assembler")[i % 3] for i in range(kills)]
    rng.shuffle(kinds)
    for _ in range(redis_kills):
        kinds.insert(rng.randrange(1, len(kinds) + 1) if kinds else 0, "redis")
    launch = Launch(_common(run_root, run_id, steps, sft, per_step), run_root / f"{run_id}.log")
    started = time.monotonic()
    if not _wait_rows(run_dir, launch, 1, 600):
        raise RuntimeError(f"run did not reach its first step; see {run_root / f'{run_id}.log'}")
    baseline = [r["time_step"] for r in rows(run_dir)]
    injected: list[dict] = []
    for kind in kinds:
        time.sleep(rng.uniform(*gap))
        if launch.proc.poll() is not None or len(rows(run_dir)) >= steps:
            break
        deadline = time.monotonic() + 60
        pids = find_pids(launch.proc.pid, kind)
        while not pids and time.monotonic() < deadline:  # still restarting from the last kill
            time.sleep(0.1)
            pids = find_pids(launch.proc.pid, kind)
        if not pids:
            break
        pid = rng.choice(pids)
        step_at = len(rows(run_dir))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        at = time.time()
        rec = _recovery(run_dir, at, 300, launch)
        injected.append({"kind": kind, "pid": pid, "during_step": step_at, "recover_s": rec})
        if rec is None:
            break
    rc = launch.wait(1200)
    result = verify(run_dir, steps, per_step) if (run_dir / "checkpoints" / "latest").exists() else {}
    result.update(phase="workers", rc=rc, injected=injected, leftovers=launch.leftovers(),
                  wall_s=time.monotonic() - started, baseline_step_s=statistics.median(baseline) if baseline else 0,
                  run_dir=str(run_dir))
    return result


def phase_resume(run_root: Path, steps: int, sft: int, per_step: int, seed: int,
                 victims: tuple[str, ...] = ("learner", "coordinator"), auto: bool = False,
                 extra: tuple[str, ...] = ()) -> dict:
    """Kills each victim once mid-run; the run resumes from its checkpoint, by a relaunch with
    coordinator.resume=true (auto=False) or by the launcher itself (auto=True:
    cluster.max_relaunches); checks the step and data position."""
    rng = random.Random(seed + 1)
    run_id = f"chaos-{'autoresume' if auto else 'resume'}-{seed}"
    run_dir = run_root / run_id
    base = _common(run_root, run_id, steps, sft, per_step) + [
        "coordinator.checkpoint_every=2", f"cluster.max_relaunches={len(victims) if auto else 0}", *extra]
    started = time.monotonic()
    injected, launches, rcs, leftovers, errors = [], [], [], [], []
    launch = Launch(base, run_root / f"{run_id}.log")
    launches.append(launch)
    for i, victim in enumerate(victims):
        # let a checkpoint land, then kill a little into a later step: within one step's time, so that the kill
        # lands before the run's end however fast its steps are (a fixed 0-1 s outran 5 steps of 0.3 s)
        target = min(steps - 1, 3 + 3 * i)
        if not _wait_rows(run_dir, launch, target, 900):
            break
        time.sleep(rng.uniform(0.0, step_seconds(run_dir)))
        pids = find_pids(launch.proc.pid, victim)
        if not pids or launch.proc.poll() is not None:
            break
        os.kill(pids[0], signal.SIGKILL)
        at = time.time()
        marker = run_dir / "checkpoints" / "latest"  # none yet: the run starts again at step 0 (= -1 + 1)
        ckpt = json.loads((run_dir / "checkpoints" / marker.read_text().strip() / "coordinator.json").read_text()
                          )["step"] if marker.exists() else -1
        if auto:  # the launcher tears the actors down, then says so; rows after that are the resumed run's
            if not _wait_log(run_root / f"{run_id}.log", "relaunching from", i + 1, launch, 300):
                break
        n_before = len(rows(run_dir))
        if not auto:
            rcs.append(launch.wait(300))
            leftovers += launch.leftovers()
            errors.append(_last_error(run_root / f"{run_id}.log"))
            n_before = len(rows(run_dir))
            launch = Launch(base + ["coordinator.resume=true"], run_root / f"{run_id}.log")
            launches.append(launch)
        if not _wait_rows(run_dir, launch, n_before + 1, 900):
            break
        first = rows(run_dir)[n_before]["step"]
        injected.append({"kind": victim, "during_step": n_before, "checkpoint_step": ckpt, "resumed_at": int(first),
                         "recover_s": time.time() - at})
    rcs.append(launch.wait(1200))
    leftovers += launch.leftovers()
    result = verify(run_dir, steps, per_step)
    # The data position: a resumed cursor must end exactly where an uninterrupted one would.
    n_train = _train_items(run_dir)
    if n_train:
        sys.path.insert(0, str(ROOT))
        from actors.coordinator.cursor import DataCursor

        c = DataCursor(n_train, result["cursor"]["seed"])
        for _ in range(steps):
            c.take(per_step)
        result["cursor_ok"] = (c.epoch, c.position) == (result["cursor"]["epoch"], result["cursor"]["position"])
    result.update(phase="autoresume" if auto else "resume", rc=rcs, injected=injected, leftovers=leftovers, errors=errors,
                  wall_s=time.monotonic() - started, run_dir=str(run_dir),
                  resume_ok=all(k["resumed_at"] == k["checkpoint_step"] + 1 for k in injected))
    return result


def _last_error(log_path: Path) -> str:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.startswith("error:")]
    return lines[-1] if lines else ""


def _train_items(run_dir: Path) -> int:
    path = run_dir / "logs" / "launcher.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") == "prompts" and ev.get("split") == "train":
            return int(ev["kept"])
    return 0


# -- report ----------------------------------------------------------------------------------

def table(results: list[dict]) -> str:
    out = ["| phase | faults injected | steps completed | prompts | trained | lost | doubled | dropped as failed |"
           " recover median s | recover max s |", "|" + " --- |" * 10]
    for r in results:
        inj = r["injected"]
        kinds: dict[str, int] = {}
        for k in inj:
            kinds[k["kind"]] = kinds.get(k["kind"], 0) + 1
        rec = [k["recover_s"] for k in inj if k["recover_s"] is not None]
        desc = f"{len(inj)} (" + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + ")"
        out.append(f"| {r['phase']} | {desc} | {r.get('steps_completed', 0)} | {r.get('prompts', 0)} | "
                   f"{r.get('trained', 0)} | {r.get('lost', '?')} | {r.get('doubled', '?')} | {r.get('failed', '?')} | "
                   f"{statistics.median(rec) if rec else float('nan'):.1f} | {max(rec) if rec else float('nan'):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=21, help="worker kills (generator/scorer/assembler, round robin)")
    p.add_argument("--redis-kills", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--resume-steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-resume", action="store_true")
    p.add_argument("--skip-workers", action="store_true")
    p.add_argument("--run-root", default="")
    p.add_argument("--json", default="", help="also write the raw results here")
    a = p.parse_args(argv)
    run_root = work_dir(a.run_root, "arl-chaos-")
    results = [] if a.skip_workers else [
        phase_workers(run_root, a.kills, a.steps, a.sft_steps, a.prompts_per_step, a.seed, a.redis_kills)]
    if not a.skip_resume:
        for auto in (False, True):
            results.append(phase_resume(run_root, a.resume_steps, a.sft_steps, a.prompts_per_step, a.seed, auto=auto))
    print(f"machine: {os.cpu_count()}-core CPU, date: {time.strftime('%Y-%m-%d')}, run root: {run_root}")
    print(table(results))
    for r in results:
        print(f"{r['phase']}: rc={r['rc']} leftover processes={r['leftovers']} wall={r['wall_s']:.0f}s "
              f"generator resyncs={r.get('resyncs', 0)}"
              + (f" baseline step={r['baseline_step_s']:.1f}s" if "baseline_step_s" in r else "")
              + (f" resumed at checkpoint+1={r['resume_ok']} cursor matches={r.get('cursor_ok')}" if "resume" in r["phase"] else ""))
        for e in r.get("errors", []):
            print(f"  launcher said: {e}")
        for prob in r.get("problems", []):
            print(f"  PROBLEM {prob}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    ok = all(r.get("lost") == 0 and r.get("doubled") == 0 and not r.get("problems") and not r["leftovers"]
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
