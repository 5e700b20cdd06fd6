"""An hour of faults: tiny-shaped training on CPU under a random fault every ~2 minutes.

    python -m bench.faults.soak --minutes 60 --run-root /tmp/soak --json /tmp/soak.json --md /tmp/soak.md
    SOAK_MINUTES=2 pytest -q tests/e2e/test_soak.py          # the CI form (a few faults, same checks)

Two halves of --minutes / 2 each, one after the other: "colocated" (tiny as shipped, one learner rank)
and "async" (coordinator.mode=async, learner.num_ranks=2, assembler.max_staleness=1). Each half is one
launch of `python -m launch.cluster tiny` (bench.faults.procs.Launch) with a step count it never reaches,
cluster.max_relaunches high (the launcher's own relaunch from the latest checkpoint is what a learner
or coordinator death exercises), Redis with AOF, and every bound of the run set short (BOUNDS). Every
~fault_every seconds (uniform 0.5x-1.5x, seeded), once the previous fault was recovered from, one
fault (the first once the run has a checkpoint) is drawn at random from FAULTS (from a shuffled bag of all of them, refilled when empty, so every
kind comes up once in each len(FAULTS) faults):

  generator / scorer / assembler / learner (one rank) / coordinator: SIGKILL of that actor's process
      (found by Ray's process title among the launcher's descendants, bench.faults.procs.find_pids);
  redis: SIGKILL of the embedded redis-server, which the launcher's supervisor restarts from its AOF;
  hostile: a burst of RolloutGroups in the run's rollouts stream whose samples are hostile SQL
      (bench.hostile: endless CTEs, writes, stacked statements, ~100 kB queries, 1 MB of garbage) and
      one undecodable message; their task ids belong to step -1, which no step collects, so the
      assembler drops them at the next step and the scorer must stay healthy through them.

At the end of a half the soak reads Redis (memory, every stream's length and pending count: the run's
streams are trimmed once acked), takes a last RSS sample and stops the launcher with SIGTERM (its
Ctrl-C path). Then, from the latest checkpoint and metrics.jsonl (bench.faults.chaos.verify): prompts lost and
doubled over every checkpointed step. A hang is no progress (a new metrics row or a relaunch line) for
longer than the longest configured bound plus a relaunch (max(BOUNDS) + RELAUNCH_S); the half ends there and says so.

Reported per half and overall (JSON, and a markdown table): faults by kind, lost, doubled, hangs,
recovery (kill -> next completed step) p50/max by kind and for relaunches (learner, coordinator), RSS of
every process of the launcher's tree (the launcher included) that lived through the half at its start
(its first sample at least --rss-warm-s, default RSS_WARM_S, after it appeared and after the first step)
and end (growth must be <= 10 %), Redis memory and stream lengths at the end, and the held-out greedy
accuracy at the first and last evaluation. `--faults none` runs the same halves without faults: a
baseline in which every actor lives the whole half.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.faults.chaos import _common, _wait_rows, rows, verify
from bench.faults.procs import Launch, find_pids
from bench.faults.rss import RSS_EVERY_S, RSS_WARM_S, RssLog
from bench.hostile import HOSTILE_SQL, huge_text

FAULTS = ("generator", "scorer", "assembler", "learner", "coordinator", "redis", "hostile")
RELAUNCHING = ("learner", "coordinator")  # the launcher itself restarts every actor from the checkpoint
# Every bound of the run the soak sets (seconds), coordinator.call_timeout_s included: left at its 1,800 s,
# a call stuck on a restarted actor outlived the hang detector with nothing to show (the 21:48 hour, async
# half). A hang is no progress for longer than the longest bound plus RELAUNCH_S (what ends the longest
# wait, a relaunch, takes time of its own: a bound equal to the detector's raced it).
BOUNDS = {"learner.collective_timeout_s": 60, "generator.pause_timeout_s": 60, "coordinator.step_timeout_s": 300,
          "cluster.placement_timeout_s": 120, "coordinator.call_timeout_s": 120}
RELAUNCH_S = 150
HALVES = {
    "colocated": [],
    "async": ["coordinator.mode=async", "assembler.max_staleness=1", "learner.num_ranks=2", "learner.num_cpus=0.25"],
}


# -- processes and Redis -----------------------------------------------------------------------

def redis_url(root: int) -> str | None:
    """The embedded redis-server's unix socket, from its process title (`redis-server unixsocket:<path>`)."""
    for pid in find_pids(root, "redis"):
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().decode().replace("\0", " ")
        except OSError:
            continue
        for word in title.split():
            if word.startswith("unixsocket:"):
                return f"unix://{word[len('unixsocket:'):]}?db=0"
    return None


async def _redis_state(url: str, run_id: str) -> dict:
    from queues.streams import RunStreams

    conn = await RunStreams.open(url, run_id)
    try:
        r = conn.redis
        mem = await r.info("memory")
        streams = {}
        async for key in r.scan_iter(match=f"arl:{run_id}:*"):
            key = key.decode() if isinstance(key, bytes) else key
            if (await r.type(key)) in (b"stream", "stream"):
                pending = sum(int(g["pending"]) for g in await r.xinfo_groups(key))
                streams[key.rsplit(":", 1)[1]] = {"length": int(await r.xlen(key)), "pending": pending}
        return {"used_memory_mb": round(mem["used_memory"] / 2**20, 2), "peak_memory_mb":
                round(mem["used_memory_peak"] / 2**20, 2), "streams": streams}
    finally:
        await conn.close()


async def _hostile_burst(url: str, run_id: str, db_path: str, nonce: int, groups: int = 3) -> int:
    """RolloutGroups of hostile samples for step -1 (no step collects them) and one undecodable entry."""
    from queues.messages import PromptTask, RolloutGroup, Sample, codec, pack_floats, pack_ids
    from queues.streams import RunStreams
    from queues.topology import ROLLOUTS

    texts = [f"```sql\n{sql}\n```" for sql in HOSTILE_SQL.values()] + [huge_text(1 << 20)]
    conn = await RunStreams.open(url, run_id)
    try:
        out = conn.stream(ROLLOUTS)
        for g in range(groups):
            task = PromptTask(task_id=f"-1:hostile{nonce}-{g}:0", prompt_id="hostile", step=-1, policy_version=0,
                              prompt_tokens=pack_ids([1, 2, 3]), n=len(texts), db_id=Path(db_path).parent.name,
                              db_path=db_path, gold_sql="SELECT 1")
            samples = [Sample(tokens=pack_ids([4]), logprobs=pack_floats([0.0]), finish_reason="stop", text=t)
                       for t in texts]
            await out.publish(codec(RolloutGroup).encode(RolloutGroup(task=task, samples=samples, policy_version=0,
                                                                      generator_id="hostile")))
        await out.publish(b"\xc1 not msgpack")
        return groups * len(texts) + 1
    finally:
        await conn.close()


# -- one half ----------------------------------------------------------------------------------

def _progress(run_dir: Path, log_path: Path) -> tuple[int, int]:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return len(rows(run_dir)), text.count("relaunching from")


def _held_out(run_dir: Path) -> dict:
    last: dict[int, dict] = {}
    for r in rows(run_dir):
        last[int(r["step"])] = r
    evals = [(s, r["eval_accuracy"]) for s, r in sorted(last.items()) if r.get("eval_accuracy") is not None]
    if not evals:
        return {"evals": 0}
    return {"evals": len(evals), "first_step": evals[0][0], "first": round(evals[0][1], 3), "last_step": evals[-1][0],
            "last": round(evals[-1][1], 3), "best": round(max(a for _, a in evals), 3),
            "climbed": evals[-1][1] > evals[0][1]}


def _kill(launch: Launch, kind: str, rng: random.Random, wait_s: float = 60.0) -> int | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and launch.proc.poll() is None:
        pids = find_pids(launch.proc.pid, kind)
        if pids:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                return pid
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return None


def run_half(name: str, run_root: Path, seconds: float, fault_every: float, rng: random.Random, sft: int,
             per_step: int, eval_every: int, faults: tuple[str, ...] = FAULTS, bag: list[str] | None = None,
             extra: tuple[str, ...] = (), rss_warm_s: float = RSS_WARM_S) -> dict:
    """One launch for `seconds` under faults (none when `faults` is empty: a baseline); `bag` (shared between
    halves) holds the kinds still to draw."""
    bag = [] if bag is None else bag
    run_id = f"soak-{name}"
    run_dir, log_path = run_root / run_id, run_root / f"{run_id}.log"
    hang_s = max(BOUNDS.values()) + RELAUNCH_S
    overrides = _common(run_root, run_id, 1_000_000, sft, per_step) + HALVES[name] + [
        "coordinator.checkpoint_every=5", "cluster.max_relaunches=100000", f"coordinator.eval_every={eval_every}",
        "data.eval_size=48"] + [f"{k}={v}" for k, v in BOUNDS.items()] + list(extra)
    launch = Launch(overrides, log_path)
    result: dict = {"half": name, "run_dir": str(run_dir), "hang_bound_s": hang_s, "hangs": 0, "injected": []}
    if not _wait_rows(run_dir, launch, 1, 1200):
        launch.wait(0)
        result.update(error=f"no first step; see {log_path}", rc=launch.proc.returncode)
        return result
    started = time.monotonic()
    deadline = started + seconds
    rss = RssLog(rss_warm_s)
    next_rss = 0.0
    progress, progress_t = _progress(run_dir, log_path), time.monotonic()
    next_fault = started + rng.uniform(0.5, 1.5) * fault_every
    open_fault: dict | None = None
    redis_end: dict = {}
    while True:
        now = time.monotonic()
        launch.watch()
        if now >= next_rss:
            rss.sample(launch.proc.pid, now, started)
            next_rss = now + RSS_EVERY_S
        if launch.proc.poll() is not None:
            result["error"] = f"the launcher exited {launch.proc.returncode} mid-soak; see {log_path}"
            break
        p = _progress(run_dir, log_path)
        if p != progress:
            progress, progress_t = p, now
            if open_fault is not None and p[0] > open_fault["rows_at"]:
                open_fault["recover_s"] = round(time.time() - open_fault["at"], 1)
                open_fault = None
        elif now - progress_t > hang_s:
            result["hangs"] += 1
            result["error"] = (f"hang: no new step or relaunch for {now - progress_t:.0f} s (> {hang_s} s) "
                               f"after {result['injected'][-1]['kind'] if result['injected'] else 'no fault'}")
            break
        if now >= deadline:
            if open_fault is None or now - open_fault["t"] > hang_s:
                break
        elif faults and open_fault is None and now >= next_fault and (run_dir / "checkpoints" / "latest").exists():
            # (not before the first checkpoint: a learner or coordinator death then ends the launch, as it
            # has nothing to relaunch from; docs/reliability/soak.md)
            if not bag:
                bag = rng.sample(faults, len(faults))
            kind = bag.pop()
            step_at = len(rows(run_dir))
            fault = {"kind": kind, "during_step": step_at, "rows_at": step_at, "t": now, "at": time.time(),
                     "recover_s": None}
            if kind == "hostile":
                url = redis_url(launch.proc.pid)
                dbs = sorted((run_dir / "data").rglob("*.sqlite"))
                if url is None or not dbs:
                    fault["skipped"] = "no redis-server or database found"
                else:
                    try:
                        fault["entries"] = asyncio.run(_hostile_burst(url, run_id, str(dbs[0]), len(result["injected"])))
                    except Exception as e:  # noqa: BLE001 - e.g. Redis restarting this moment: reported
                        fault["skipped"] = f"burst not sent: {type(e).__name__}: {str(e)[:200]}"
            else:
                fault["pid"] = _kill(launch, kind, rng)
                if fault["pid"] is None:
                    fault["skipped"] = "no such process within 60 s"
            result["injected"].append(fault)
            open_fault = fault if "skipped" not in fault else None
            next_fault = now + rng.uniform(0.5, 1.5) * fault_every
        time.sleep(1.0)
    end_t = time.monotonic()
    rss.sample(launch.proc.pid, end_t, started)
    url = redis_url(launch.proc.pid)
    if url and launch.proc.poll() is None:
        try:
            redis_end = asyncio.run(_redis_state(url, run_id))
        except Exception as e:  # noqa: BLE001 - reported, the soak goes on to its verdict
            redis_end = {"error": str(e)[:200]}
    if launch.proc.poll() is None:
        os.kill(launch.proc.pid, signal.SIGTERM)  # the launcher's Ctrl-C path: every actor and Redis stopped
    rc = launch.wait(300)
    latest = run_dir / "checkpoints" / "latest"
    if latest.exists():
        state = json.loads((run_dir / "checkpoints" / latest.read_text().strip() / "coordinator.json").read_text())
        result.update(verify(run_dir, state["step"] + 1, per_step))
    log_text = log_path.read_text(errors="replace")
    result.update(rc=rc, leftovers=launch.leftovers(), minutes=round((end_t - started) / 60, 1),
                  rss=rss.report(end_t, min_life_s=min(600.0, (end_t - started) / 2)), redis=redis_end,
                  held_out=_held_out(run_dir), relaunches=log_text.count("relaunching from"),
                  rows=len(rows(run_dir)))
    return result


# -- report ------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else None


def summarize(halves: list[dict]) -> dict:
    inj = [f for h in halves for f in h["injected"]]
    by_kind: dict[str, dict] = {}
    for kind in FAULTS:
        mine = [f for f in inj if f["kind"] == kind and "skipped" not in f]
        rec = [f["recover_s"] for f in mine if f["recover_s"] is not None]
        by_kind[kind] = {"injected": len(mine), "recovered": len(rec), "p50_s": _pct(rec, 0.5),
                         "max_s": max(rec) if rec else None}
    relaunch = [f["recover_s"] for f in inj if f["kind"] in RELAUNCHING and f["recover_s"] is not None]
    rss = [p for h in halves for p in h.get("rss", [])]
    return {
        "faults": sum(v["injected"] for v in by_kind.values()), "by_kind": by_kind,
        "unrecovered": sum(v["injected"] - v["recovered"] for v in by_kind.values()),
        "lost": sum(h.get("lost", 0) for h in halves), "doubled": sum(h.get("doubled", 0) for h in halves),
        "bad_rows": sum(h.get("bad_rows", 0) for h in halves), "hangs": sum(h["hangs"] for h in halves),
        "errors": [h["error"] for h in halves if h.get("error")],
        "leftovers": [p for h in halves for p in h.get("leftovers", [])],
        "relaunch_p50_s": _pct(relaunch, 0.5), "relaunch_max_s": max(relaunch) if relaunch else None,
        "rss_max_growth_pct": max((p["growth_pct"] for p in rss), default=None),
    }


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(halves: list[dict], s: dict) -> str:
    out = ["| fault | injected | recovered | recovery p50 s | recovery max s |", "|---|---|---|---|---|"]
    for kind, v in s["by_kind"].items():
        out.append(f"| {kind} | {v['injected']} | {v['recovered']} | {_f(v['p50_s'])} | {_f(v['max_s'])} |")
    out += ["", "| half | minutes | steps checkpointed | prompts | trained | lost | doubled | hangs | relaunches |"
            " held-out greedy first -> last (best) | exit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for h in halves:
        ho = h.get("held_out", {})
        held = (f"{ho['first']} (step {ho['first_step']}) -> {ho['last']} (step {ho['last_step']}) ({ho['best']})"
                if ho.get("evals") else "-")
        out.append(f"| {h['half']} | {h.get('minutes', '-')} | {h.get('steps_completed', '-')} | {h.get('prompts', '-')} |"
                   f" {h.get('trained', '-')} | {h.get('lost', '-')} | {h.get('doubled', '-')} | {h['hangs']} |"
                   f" {h.get('relaunches', '-')} | {held} | {h.get('rc', '-')} |")
    out += ["", f"relaunch (learner/coordinator kill -> next step) p50 {_f(s['relaunch_p50_s'])} s, max "
            f"{_f(s['relaunch_max_s'])} s; hang bound {max(BOUNDS.values()) + RELAUNCH_S} s", "",
            "| half | process | minutes | RSS start MB | RSS end MB | growth % |", "|---|---|---|---|---|---|"]
    for h in halves:
        for p in h.get("rss", []):
            out.append(f"| {h['half']} | {p['name']} | {p['minutes']} | {p['start_mb']} | {p['end_mb']} | {p['growth_pct']} |")
    out += ["", "| half | Redis used MB (peak) | stream: length / pending at the end |", "|---|---|---|"]
    for h in halves:
        r = h.get("redis") or {}
        streams = ", ".join(f"{k} {v['length']}/{v['pending']}" for k, v in sorted(r.get("streams", {}).items()))
        out.append(f"| {h['half']} | {r.get('used_memory_mb', '-')} ({r.get('peak_memory_mb', '-')}) | "
                   f"{streams or r.get('error', '-')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 60)),
                   help="both halves together (default $SOAK_MINUTES or 60)")
    p.add_argument("--fault-every", type=float, default=120.0, help="mean seconds between faults")
    p.add_argument("--halves", default="colocated,async")
    p.add_argument("--faults", default=",".join(FAULTS), help="kinds to draw from, or none (a fault-free baseline)")
    p.add_argument("--rss-warm-s", type=float, default=RSS_WARM_S,
                   help="a process's RSS start: its first sample this long after it appeared (and after the first step)")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="a config override for both halves' launches")
    p.add_argument("--run-root", default="")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="")
    a = p.parse_args(argv)
    run_root = Path(a.run_root or tempfile.mkdtemp(prefix="arl-soak-")).absolute()
    run_root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    names = a.halves.split(",")
    faults = () if a.faults == "none" else tuple(a.faults.split(","))
    unknown = set(names) - set(HALVES) | set(faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown half or fault: {', '.join(sorted(unknown))}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    halves: list[dict] = []
    bag: list[str] = []
    for name in names:
        h = run_half(name, run_root, 60 * a.minutes / len(names), a.fault_every, rng, a.sft_steps, a.prompts_per_step,
                     a.eval_every, faults, bag, tuple(a.override), a.rss_warm_s)
        halves.append(h)
        print(f"{name}: {json.dumps({k: v for k, v in h.items() if k not in ('injected', 'rss', 'problems')}, default=str)}",
              flush=True)
    s = summarize(halves)
    load = os.getloadavg()
    head = (f"machine: {os.cpu_count()}-core CPU, load average {load[0]:.1f} at the end, started {started}, "
            f"{a.minutes:g} minutes, a fault every ~{a.fault_every:g} s, seed {a.seed}, run root {run_root}")
    md = head + "\n\n" + markdown(halves, s)
    print(md)
    for h in halves:
        for prob in h.get("problems", []):
            print(f"  PROBLEM {h['half']}: {prob}")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": s, "halves": halves, "head": head}, indent=1, default=str))
    if a.md:
        Path(a.md).write_text(md + "\n")
    ok = (s["lost"], s["doubled"], s["hangs"], s["bad_rows"], s["unrecovered"]) == (0, 0, 0, 0, 0) \
        and not s["errors"] and not s["leftovers"] and all(h.get("rc") == 130 for h in halves)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
