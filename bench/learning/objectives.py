"""Which objective and reward wins on tiny? The same recipe, seeds and steps under each learner objective
(issue 28) and with the partial SQL reward terms.

    .venv/bin/python -m bench.learning.objectives                              # seeds 0 1 2, 30 steps, eval every 10
    SEEDS=0 STEPS=10 VARIANTS="ppo_clip cispo" .venv/bin/python -m bench.learning.objectives

Every variant runs tiny with learner.update_epochs=$EPOCHS (default 2): tiny is colocated with one epoch,
i.e. exactly on-policy, where ppo_clip, cispo and (at seq-mean) gspo are the same REINFORCE gradient
(tests/unit/test_objectives.py); only off-policy epochs tell them apart. Two launcher processes at a time
(the 2 cores), variant pairs then seeds. Reads each run's metrics.jsonl: held-out greedy accuracy
(eval_accuracy) and the sampled answers' execution accuracy (eval_sample_accuracy) at every evaluation;
not eval_reward_mean, which is the training reward, partial terms included, so it does not compare across
the +terms variant (0.354 against 0.201 for the same warm start, 2026-12-04). Writes $OUT/objectives.json,
$OUT/objectives.md (the table, also on stdout) and
$OUT/objectives.png (greedy accuracy per variant, mean over seeds).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.learning.tiny_turns import curve

REPO = Path(__file__).resolve().parents[2]
SEEDS = [int(s) for s in os.environ.get("SEEDS", "0 1 2").split()]
STEPS = int(os.environ.get("STEPS", "30"))
EVAL_EVERY = int(os.environ.get("EVAL_EVERY", "10"))
EPOCHS = int(os.environ.get("EPOCHS", "2"))
OUT = Path(os.environ.get("OUT", "") or tempfile.mkdtemp(prefix="arl-objectives-"))
VARIANTS: dict[str, list[str]] = {
    "ppo_clip": [],
    "dr_grpo": ["learner.loss_agg=seq-mean-token-sum-norm", "assembler.normalize_std=false"],
    "gspo": ["learner.loss=gspo", "learner.loss_agg=seq-mean-token-mean", "learner.clip_low=0.0003",
             "learner.clip_high=0.0004"],
    "cispo": ["learner.loss=cispo", "learner.clip_low=1.0"],
    "ppo_clip+terms": ["scorer.reward_syntax=0.1", "scorer.reward_schema_linking=0.1", "scorer.reward_format=0.05"],
}
CHOSEN = os.environ.get("VARIANTS", " ".join(VARIANTS)).split()


def launch(name: str, seed: int) -> subprocess.Popen:
    run_id = f"{name.replace('+', '_')}-s{seed}"
    args = [sys.executable, "-m", "launch.cluster", "tiny", f"seed={seed}", f"coordinator.steps={STEPS}",
            f"coordinator.eval_every={EVAL_EVERY}", f"coordinator.checkpoint_every={STEPS}",
            f"learner.update_epochs={EPOCHS}", f"run_root={OUT}", f"run_id={run_id}", *VARIANTS[name]]
    log = open(OUT / f"{run_id}.console", "w")
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def table(results: dict) -> str:
    lines = ["| variant | seeds | greedy first -> last (mean) | greedy last per seed | sampled accuracy last (mean) |",
             "| --- | --- | --- | --- | --- |"]
    for name in CHOSEN:
        runs = [results.get(f"{name}-s{s}", {}) for s in SEEDS]
        done = [r["evals"] for r in runs if r.get("evals")]
        if not done:
            rcs = ", ".join(f"rc {r.get('rc')}" for r in runs)
            lines.append(f"| {name} | 0/{len(SEEDS)} ({rcs}; see its .console) | - | - | - |")
            continue
        first = sum(e[0][1] for e in done) / len(done)
        last = sum(e[-1][1] for e in done) / len(done)
        reward = sum(e[-1][3] for e in done) / len(done)  # execution accuracy of the samples, not the shaped reward
        per_seed = ", ".join(f"{e[-1][1]:.3f}" for e in done)
        lines.append(f"| {name} | {len(done)}/{len(SEEDS)} | {first:.3f} -> {last:.3f} | {per_seed} | {reward:.3f} |")
    lines.append(f"\ntiny, {STEPS} GRPO steps, learner.update_epochs={EPOCHS}, held-out eval every {EVAL_EVERY}.")
    return "\n".join(lines)


def plot(results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not any(r.get("evals") for r in results.values()):
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in CHOSEN:
        curves = [results[k]["evals"] for k in (f"{name}-s{s}" for s in SEEDS) if results.get(k, {}).get("evals")]
        if curves:
            n = min(len(c) for c in curves)
            ax.plot([curves[0][i][0] for i in range(n)], [sum(c[i][1] for c in curves) / len(curves) for i in range(n)],
                    "-o", label=name)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out greedy accuracy (mean over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "objectives.png", dpi=110)


def main() -> int:
    unknown = [v for v in CHOSEN if v not in VARIANTS]
    if unknown:
        print(f"VARIANTS: unknown {unknown}; choose from {' '.join(VARIANTS)}", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    jobs = [(name, seed) for seed in SEEDS for name in CHOSEN]
    for i in range(0, len(jobs), 2):
        t0 = time.time()
        procs = {(n, s): launch(n, s) for n, s in jobs[i:i + 2]}
        for (n, s), p in procs.items():
            rc = p.wait(timeout=3600)
            run = OUT / f"{n.replace('+', '_')}-s{s}"
            results[f"{n}-s{s}"] = dict(curve(run), rc=rc) if rc == 0 else {"rc": rc}
        print(f"{[f'{n}-s{s}' for n, s in procs]}: {time.time() - t0:.0f} s", flush=True)
        (OUT / "objectives.json").write_text(json.dumps(results, indent=1))
        (OUT / "objectives.md").write_text(table(results) + "\n")
    print(table(results))
    plot(results)
    print(f"results: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
