"""LoRA RL against full fine-tuning on tiny (issue 39): `tiny_lora` and `tiny`, the same seeds, one run at a time.

    nice .venv/bin/python -m bench.learning.lora                      # seeds 0 1 2, tiny_lora then tiny per seed
    SEEDS=0 ARMS="tiny_lora" .venv/bin/python -m bench.learning.lora  # one arm, one seed
    OUT=/tmp/lora_bench .venv/bin/python -m bench.learning.lora       # where the runs and lora.json go

Each run is `python -m launch.cluster <arm> seed=S` (the recipe's own steps, warm start and evaluations), its
process tree sampled every 0.5 s for the learner's and the generator's resident memory (Ray names their
processes ray::LearnerShell / ray::GeneratorShell). Read from each run: the held-out greedy accuracy and
sampled reward after the warm start (step -1) and at the last evaluation, the median of the steps' learner
samples/s and whole-step samples/s, the bytes each step's weight sync moved (weight_sync_bytes), the learner's
trainable parameters (its learner.ready line) and the wall time. Writes $OUT/lora.json and prints the table.
The issue's bar: tiny_lora's held-out greedy >= its warm start + 0.10 on every seed.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEEDS = [int(s) for s in os.environ.get("SEEDS", "0 1 2").split()]
ARMS = tuple(os.environ.get("ARMS", "tiny_lora tiny").split())
OUT = Path(os.environ.get("OUT", "") or tempfile.mkdtemp(prefix="arl-lora-"))
MIB = float(1 << 20)


def run(arm: str, seed: int) -> dict:
    """One launch, its process tree's peak memory sampled while it runs."""
    import psutil

    run_id = f"{arm}-s{seed}"
    args = [sys.executable, "-m", "launch.cluster", arm, f"seed={seed}", f"run_root={OUT}", f"run_id={run_id}"]
    t0 = time.time()
    with open(OUT / f"{run_id}.console", "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        peak = {"learner": 0, "generator": 0}
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for p in root.children(recursive=True):
                    name = p.name()
                    for role, title in (("learner", "ray::LearnerShell"), ("generator", "ray::GeneratorShell")):
                        if name.startswith(title) or " ".join(p.cmdline()[:1]).startswith(title):
                            peak[role] = max(peak[role], p.memory_info().rss)
            except (psutil.Error, OSError):
                pass
            time.sleep(0.5)
    out = {"rc": proc.returncode, "wall_s": time.time() - t0, "peak_rss_mib": {k: v / MIB for k, v in peak.items()}}
    if proc.returncode == 0:
        out.update(read_run(OUT / run_id))
    return out


def read_run(run_dir: Path) -> dict:
    evals, train_sps, step_sps, sync_bytes = [], [], [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval_accuracy" in m:
            evals.append((m.get("step", -1), m["eval_accuracy"], m.get("eval_reward_mean", 0.0)))
        if m.get("step", -1) >= 0:
            for key, into in (("train_samples_per_s", train_sps), ("samples_per_s", step_sps),
                              ("weight_sync_bytes", sync_bytes)):
                if isinstance(m.get(key), (int, float)):
                    into.append(float(m[key]))
    trainable = None
    for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "learner.ready":
            trainable = e.get("trainable_params")
    def med(xs):
        return (statistics.median(xs) if xs else float("nan"))
    return {"evals": evals, "train_samples_per_s": med(train_sps), "samples_per_s": med(step_sps),
            "sync_bytes": med(sync_bytes), "trainable_params": trainable}


def table(results: dict) -> str:
    lines = ["| arm | seed | greedy: warm start -> last (rise) | reward: warm start -> last | learner samples/s | "
             "step samples/s | bytes per sync | trainable params | peak RSS learner / generator, MiB | wall |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for key, r in results.items():
        arm, seed = key.rsplit("-s", 1)
        if not r.get("evals"):
            lines.append(f"| {arm} | {seed} | rc {r.get('rc')} | | | | | | | |")
            continue
        first, last = r["evals"][0], r["evals"][-1]
        rss = r["peak_rss_mib"]
        lines.append(f"| {arm} | {seed} | {first[1]:.3f} -> {last[1]:.3f} ({last[1] - first[1]:+.3f}) | "
                     f"{first[2]:.3f} -> {last[2]:.3f} | {r['train_samples_per_s']:.1f} | {r['samples_per_s']:.1f} | "
                     f"{r['sync_bytes']:,.0f} | {r['trainable_params']:,} | {rss['learner']:.0f} / {rss['generator']:.0f} | "
                     f"{r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "lora.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for seed in SEEDS:
        for arm in ARMS:
            results[f"{arm}-s{seed}"] = run(arm, seed)
            path.write_text(json.dumps(results, indent=1))
            print(f"{arm} seed {seed}: rc {results[f'{arm}-s{seed}']['rc']}", flush=True)
    print(table(results))
    print(f"results: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
