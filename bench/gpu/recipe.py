"""The gpu1_0p6b recipe on one GPU, seed after seed: held-out curves, step times, device memory, the end.

    python3 -m bench.gpu.recipe                 # H200, after shared/gpu/device-setup.sh: seeds 0 and 1
    SEEDS=0 python3 -m bench.gpu.recipe         # one seed
    SMOKE=1 .venv/bin/python -m bench.gpu.recipe   # CPU: the tiny recipe, 4 steps a seed (the plumbing)

Each seed is the README's plain command, `python -m launch.cluster gpu1_0p6b seed=S` (a fresh launcher,
its own Ray and embedded Redis), with run_root outside $OUT (checkpoints are GBs); beside it
`nvidia-smi -lms 200` samples the device's memory. $OUT holds five files (the device tool brings back at
most 8), rewritten after every seed, so a device call cut short still leaves the seeds it finished:

    $OUT/summary.md     one row per seed: wall, steps, held-out reward and greedy accuracy before -> after
                        (rise; "ok" when both rose >= 0.15), step seconds, learner tokens/s and samples/s,
                        whole-step samples/s, weight-sync share, mismatch KL, device memory (peak before
                        step 1, in step 1, over steps 2..N, after the last step), raylet lines, actors left,
                        the warm start's seconds a step (and how many of them inside the learner), and the
                        launcher's start-up memory marks (launch/startup_memory.py: per phase, the device's
                        use and the learner's allocator peak and the engine's reserved, GiB)
    $OUT/summary.json   the same, machine-readable
    $OUT/curves.csv     seed, step, held-out sampled reward, greedy accuracy, sampled accuracy (step -1:
                        the warm start, before training)
    $OUT/runs.tar.gz    per seed: metrics.jsonl, config.json, logs/*.jsonl, the console output and
                        mem.csv (the memory samples: unix time, MiB used)
    $OUT/seeds.png      launch.report's comparison of the seeds (when matplotlib imports)

Env: SEEDS ("0 1"), RECIPE (gpu1_0p6b; tiny with SMOKE=1), EXTRA (more overrides, space-separated),
RUN_TIMEOUT_S (480: the issue's 8 minutes), BUDGET_S (570: the whole script, under the device's 600 s a
call; a seed that would not fit is skipped and said so), OUT (./bench_out), RUN_ROOT (/tmp/gpu_recipe_runs).
On the H200 the environment of shared/gpu/device-setup.sh is set here when /tmp/site2 exists
(PYTHONPATH=/tmp/site2:/tmp/site:<repo>, PATH, LD_LIBRARY_PATH); this process itself needs only the
standard library. Exit 0 when every seed that ran exited 0.
"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
RECIPE = os.environ.get("RECIPE", "tiny" if SMOKE else "gpu1_0p6b")
SEEDS = [int(s) for s in os.environ.get("SEEDS", "0 1").split()]
EXTRA = os.environ.get("EXTRA", "").split()
RUN_TIMEOUT_S = float(os.environ.get("RUN_TIMEOUT_S", "480"))
BUDGET_S = float(os.environ.get("BUDGET_S", "570"))
OUT = Path(os.environ.get("OUT") or "bench_out").absolute()
RUN_ROOT = Path(os.environ.get("RUN_ROOT", "/tmp/gpu_recipe_runs"))
KEEP = RUN_ROOT / "keep"  # what runs.tar.gz packs: one folder per seed
SMOKE_OVERRIDES = ["coordinator.steps=4", "model.tiny_sft_steps=20", "coordinator.eval_every=2", "data.eval_samples=2",
                   "coordinator.prompts_per_step=8", "coordinator.checkpoint_every=0"]
RISE = 0.15  # the bar, per seed, for both held-out figures


def device_env() -> dict[str, str]:
    """The launcher's environment: shared/gpu/device-setup.sh's exports when its site folders exist."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the launcher starts its own Ray, as the README's command does
    if Path("/tmp/site2").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(["/tmp/site2", "/tmp/site", str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PATH"] = "/tmp/site2/bin" + os.pathsep + env.get("PATH", "")
        cu13 = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join([cu13, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class MemorySampler:
    """`nvidia-smi -lms 200` in the background: (unix time, MiB used) of GPU 0; nothing without nvidia-smi."""

    def __init__(self, path: Path):
        self.path, self.samples, self.proc, self.thread = path, [], None, None

    def start(self) -> "MemorySampler":
        if shutil.which("nvidia-smi") is None:
            return self
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-lms", "200"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:
                pass

    def stop(self) -> list[tuple[float, float]]:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.thread.join(timeout=5)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerows([("time", "mib_used")] + [(f"{t:.3f}", m) for t, m in self.samples])
        return self.samples


def run_seed(seed: int, timeout_s: float, recipe: str | None = None, extra: list[str] | None = None,
             tag: str = "") -> dict:
    """One launcher run of `recipe` (RECIPE) with `extra` overrides (EXTRA) at `seed`, kept under
    KEEP/<run id> (`<recipe><tag>-s<seed>`)."""
    recipe = recipe or RECIPE
    run_id = f"{recipe}{tag}-s{seed}"
    shutil.rmtree(RUN_ROOT / run_id, ignore_errors=True)
    cmd = [sys.executable, "-m", "launch.cluster", recipe, f"seed={seed}", f"run_root={RUN_ROOT}", f"run_id={run_id}",
           *(SMOKE_OVERRIDES if SMOKE else []), *(EXTRA if extra is None else extra)]
    print(f"[gpu_recipe] seed {seed}: {' '.join(cmd[1:])} (timeout {timeout_s:.0f} s)", flush=True)
    kept = KEEP / run_id
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    sampler = MemorySampler(kept / "mem.csv").start()
    t0 = time.time()
    with open(kept / "console.txt", "w") as console:
        proc = subprocess.Popen(cmd, cwd=REPO, env=device_env(), stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # SIGTERM: the launcher tears down in order; then the group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            rc = f"timeout ({rc})"
    wall = time.time() - t0
    samples = sampler.stop()
    run_dir = RUN_ROOT / run_id
    for name in ("metrics.jsonl", "config.json"):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, kept / name)
    if (run_dir / "logs").is_dir():
        shutil.copytree(run_dir / "logs", kept / "logs", dirs_exist_ok=True)
    console_text = (kept / "console.txt").read_text(errors="replace")
    out = {"seed": seed, "recipe": recipe, "run_id": run_id, "rc": rc, "wall_s": round(wall, 1)}
    out.update(summarize(kept, samples, console_text))
    print(f"[gpu_recipe] seed {seed}: rc {rc}, {wall:.0f} s, {out.get('steps', 0)} steps, "
          f"reward rise {out.get('reward_rise')}, greedy rise {out.get('greedy_rise')}", flush=True)
    return out


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def summarize(run_dir: Path, mem: list[tuple[float, float]], console: str) -> dict:
    """A finished (or cut) run's figures from its metrics.jsonl, launcher and learner logs, console and memory samples."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [r for r in rows if r["step"] >= 0]
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    out: dict = {"steps": len(steps)}
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        out["eval_steps"] = f"{first['step']}..{last['step']}"
        for name, key in (("reward", "eval_reward_mean"), ("greedy", "eval_accuracy")):
            if first.get(key) is not None and last.get(key) is not None:
                out[f"{name}_before"], out[f"{name}_after"] = round(first[key], 3), round(last[key], 3)
                out[f"{name}_rise"] = round(last[key] - first[key], 3)
        out["ok"] = all(out.get(f"{k}_rise", -1) >= RISE for k in ("reward", "greedy"))
    later = steps[1:] or steps
    out.update({"step_s": _median(later, "time_step"), "generation_s": _median(later, "time_generation"),
                "training_s": _median(later, "time_training"), "sync_s": _median(later, "time_weight_sync"),
                "learner_tokens_per_s": _median(later, "train_tokens_per_s"),
                "learner_samples_per_s": _median(later, "train_samples_per_s"),
                "step_samples_per_s": _median(later, "samples_per_s"),
                "train_tokens_per_step": _median(later, "train_num_tokens"),
                "mismatch_kl": _median(later, "train_mismatch_kl"),
                "prompts": sum(r.get("prompts", 0) for r in steps),
                "prompts_trained": sum(r.get("prompts_trained", 0) for r in steps)})
    if out["sync_s"] and out["step_s"]:
        out["sync_share"] = round(out["sync_s"] / out["step_s"], 4)
    synced = [r["weight_sync_bytes"] for r in later if isinstance(r.get("weight_sync_bytes"), (int, float))
              and not math.isnan(r["weight_sync_bytes"])]  # NaN: a step that synced nothing
    out["sync_mib"] = round(statistics.median(synced) / 2**20, 2) if synced else None
    ready = [e for e in log_events(run_dir / "logs" / "learner.jsonl") if e.get("event") == "learner.ready"]
    out["trainable_params"] = ready[-1].get("trainable_params") if ready else None
    out["raylet_lines"] = sum("(raylet)" in line for line in console.splitlines())
    events = log_events(run_dir / "logs" / "launcher.jsonl")
    stopped = [e for e in events if e.get("event") == "actors stopped"]
    out["actors_alive_after"] = stopped[-1].get("alive") if stopped else None
    out.update(startup_memory(events))
    warm = [e for e in log_events(run_dir / "logs" / "coordinator.jsonl") if e.get("event") == "warm-start done"]
    if warm:  # the warm start through the learner: wall, rank 0's time inside the steps, per step, calls
        out.update({k: warm[-1].get(f) for k, f in (("sft_s", "time_sft"), ("sft_learner_s", "time_sft_learner"),
                                                     ("sft_step_s", "sft_step_s"), ("sft_calls", "sft_calls"))})
    if mem and steps:
        def start(r: dict) -> float:  # the row is written after the step's eval and checkpoint
            return r["time"] - r["time_step"] - r.get("time_eval", 0.0) - r.get("time_checkpoint", 0.0)

        t1 = start(steps[0])
        t2 = start(steps[1]) if len(steps) > 1 else steps[0]["time"]
        end = steps[-1]["time"]

        def peak(lo: float, hi: float) -> float | None:
            vals = [m for t, m in mem if lo <= t < hi]
            return round(max(vals) / 1024, 2) if vals else None
        out.update({"mem_before_step1_gib": peak(0, t1), "mem_step1_gib": peak(t1, t2),
                    "mem_steps2_n_gib": peak(t2, end), "mem_after_last_step_gib": peak(end, float("inf")),
                    "mem_peak_gib": round(max(m for _, m in mem) / 1024, 2)})
    return out


def log_events(path: Path) -> list[dict]:
    """A structlog JSON-lines file's events ([] when absent; a line that is not JSON is skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def startup_memory(events: list[dict]) -> dict:
    """The launcher's `start-up memory` marks (launch/startup_memory.py): per phase, the device's use and the
    learner's and the engine's allocator peaks since the previous mark (GiB), and one compact line."""
    rows = [e for e in events if e.get("event") == "start-up memory"]
    out: dict = {"startup_memory": [{k: v for k, v in e.items() if k not in ("event", "level", "timestamp", "actor")}
                                    for e in rows]}
    out["startup_line"] = " / ".join(
        f"{e['phase']} {e.get('device_used_gib', '?')} (learner peak {e.get('learner_max_reserved_gib', '?')}, "
        f"engine {e.get('engine_reserved_gib', '?')})" for e in rows)
    return out


COLUMNS = [("seed", "seed"), ("rc", "rc"), ("wall_s", "wall s"), ("steps", "steps"),
           ("reward_before", "held-out reward before"), ("reward_after", "after"), ("reward_rise", "rise"),
           ("greedy_before", "greedy acc. before"), ("greedy_after", "after"), ("greedy_rise", "rise"),
           ("ok", f"both >= {RISE}"), ("step_s", "step s (median)"), ("learner_tokens_per_s", "learner tok/s"),
           ("learner_samples_per_s", "learner samples/s"), ("step_samples_per_s", "samples/s (whole step)"),
           ("sync_share", "sync share"), ("mismatch_kl", "mismatch KL"),
           ("mem_before_step1_gib", "GiB before step 1"), ("mem_step1_gib", "GiB step 1"),
           ("mem_steps2_n_gib", "GiB steps 2..N"), ("mem_after_last_step_gib", "GiB after last step"),
           ("raylet_lines", "raylet lines"), ("actors_alive_after", "actors left"),
           ("sft_step_s", "warm-start s/step"), ("sft_learner_s", "of which in the learner, s"),
           ("startup_line", "start-up GiB by phase: device (learner allocator peak, engine)")]


def table(columns: list[tuple[str, str]], results: list[dict], notes: list[str]) -> list[str]:
    """A markdown table of `results` under `columns` (key, heading), then the notes as a list."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + " --- |" * len(columns)]
    for r in results:
        lines.append("| " + " | ".join("" if r.get(k) is None else str(r[k]) for k, _ in columns) + " |")
    return lines + [""] + [f"- {n}" for n in notes]


def pack_runs(path: Path, results: list[dict]) -> None:
    """runs.tar.gz: each result's kept folder (KEEP/<run id>)."""
    with tarfile.open(path, "w:gz") as tar:
        for r in results:
            tar.add(KEEP / r["run_id"], arcname=r["run_id"])


def write_summary(results: list[dict], notes: list[str]) -> None:
    (OUT / "summary.json").write_text(json.dumps({"recipe": RECIPE, "smoke": SMOKE, "extra": EXTRA,
                                                  "results": results, "notes": notes}, indent=1))
    lines = [f"# {RECIPE}: {len(results)} seed(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             *table(COLUMNS, results, notes)]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    pack_runs(OUT / "runs.tar.gz", results)
    with open(OUT / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "step", "eval_reward_mean", "eval_accuracy", "eval_sample_accuracy"])
        for r in results:
            path = KEEP / r["run_id"] / "metrics.jsonl"
            for row in (json.loads(x) for x in path.read_text().splitlines()) if path.exists() else []:
                if row.get("eval_accuracy") is not None:
                    w.writerow([r["seed"], row["step"], row.get("eval_reward_mean"), row["eval_accuracy"],
                                row.get("eval_sample_accuracy")])


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results, notes = [], []
    for seed in SEEDS:
        left = BUDGET_S - (time.time() - t0)
        need = results[-1]["wall_s"] if results else 0.0
        if left < max(need, 60.0):
            notes.append(f"seed {seed} not run: {left:.0f} s of BUDGET_S={BUDGET_S:g} left, the last seed took "
                         f"{need:.0f} s (run it in its own call: SEEDS={seed})")
            break
        results.append(run_seed(seed, min(RUN_TIMEOUT_S, left)))
        write_summary(results, notes)
    runs = [str(KEEP / r["run_id"]) for r in results if (KEEP / r["run_id"] / "metrics.jsonl").exists()]
    if runs:
        fig = subprocess.run([sys.executable, "-m", "launch.report", *runs, "--out", str(OUT / "seeds.png")], cwd=REPO,
                             env=device_env(), capture_output=True, text=True, timeout=120)
        if fig.returncode != 0:
            notes.append(f"figure not drawn: {(fig.stdout + fig.stderr).strip().splitlines()[-1:]}")
    write_summary(results, notes)
    print((OUT / "summary.md").read_text(), flush=True)
    return 0 if results and all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
