"""Does revising pay on tiny? `tiny_forms` (one turn) against `tiny_look` (max_turns=3, the same task: values
stored in a per-database form that one query reveals), the same seeds and steps.

    .venv/bin/python -m bench.learning.tiny_turns                 # seeds 0 1 2, 30 steps, eval every 10
    SEEDS=0 STEPS=10 .venv/bin/python -m bench.learning.tiny_turns
    RECIPES="tiny tiny_mt" .venv/bin/python -m bench.learning.tiny_turns   # the earlier pair (docs/perf/tiny.md)
    OVERRIDES="data.synthetic_questions=3000" .venv/bin/python -m bench.learning.tiny_turns   # given to both recipes
    MERGE="/tmp/tt0 /tmp/tt1 /tmp/tt2" .venv/bin/python -m bench.learning.tiny_turns   # no runs: one table and figure
                                                                            # from earlier OUT dirs (seeds run apart)

Each seed runs both recipes side by side (two launcher processes on the 2 cores), then the next seed.
Reads each run's metrics.jsonl: the held-out greedy accuracy (eval_accuracy) and sampled reward
(eval_reward_mean) at every evaluation, and the last step's turns_mean / tool_use_frac / revision_gain.
Writes $OUT/tiny_turns.json, a markdown table on stdout and $OUT/tiny_turns.png (held-out greedy
accuracy per seed, both recipes). The issue's bar: the multi-turn recipe (the second) >= the one-turn one + 0.05
greedy at the last step, every seed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEEDS = [int(s) for s in os.environ.get("SEEDS", "0 1 2").split()]
STEPS = int(os.environ.get("STEPS", "30"))
EVAL_EVERY = int(os.environ.get("EVAL_EVERY", "10"))
OUT = Path(os.environ.get("OUT", "") or tempfile.mkdtemp(prefix="arl-tiny-turns-"))
RECIPES = tuple(os.environ.get("RECIPES", "tiny_forms tiny_look").split())  # (one turn, multi-turn)
OVERRIDES = os.environ.get("OVERRIDES", "").split()


def launch(recipe: str, seed: int, root: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "launch.cluster", recipe, f"seed={seed}", f"coordinator.steps={STEPS}",
            f"coordinator.eval_every={EVAL_EVERY}", f"coordinator.checkpoint_every={STEPS}", f"run_root={root}",
            f"run_id={recipe}-s{seed}", *OVERRIDES]
    log = open(root / f"{recipe}-s{seed}.console", "w")
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def curve(run_dir: Path) -> dict:
    evals, last, steps = [], {}, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval_accuracy" in m:
            evals.append((m.get("step", -1), m["eval_accuracy"], m.get("eval_reward_mean", 0.0),
                          m.get("eval_sample_accuracy", 0.0)))
        if m.get("step", -1) >= 0 and "turns_mean" in m:
            last = {k: m[k] for k in ("turns_mean", "tool_use_frac", "revision_gain", "reward_mean") if k in m}
            steps.append(last)
    mean = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in last} if steps else {}
    return {"evals": evals, "last": last, "mean": mean}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    merge = os.environ.get("MERGE", "").split()
    for d in merge:
        results.update(json.loads((Path(d) / "tiny_turns.json").read_text()))
    seeds = sorted({int(k.rsplit("-s", 1)[1]) for k in results}) if merge else SEEDS
    for seed in ([] if merge else SEEDS):
        t0 = time.time()
        procs = {r: launch(r, seed, OUT) for r in RECIPES}
        for r, p in procs.items():
            rc = p.wait(timeout=3600)
            results[f"{r}-s{seed}"] = dict(curve(OUT / f"{r}-s{seed}"), rc=rc) if rc == 0 else {"rc": rc}
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)
        (OUT / "tiny_turns.json").write_text(json.dumps(results, indent=1))
    one_name, mt_name = RECIPES
    lines = [f"| seed | {one_name} greedy (first -> last) | {mt_name} greedy (first -> last) | gap at last | "
             f"{mt_name} turns, tool use, revision gain: last step (mean over steps) |",
             "| --- | --- | --- | --- | --- |"]
    ok = True
    for seed in seeds:
        one, mt = results.get(f"{RECIPES[0]}-s{seed}", {}), results.get(f"{RECIPES[1]}-s{seed}", {})
        if not one.get("evals") or not mt.get("evals"):
            lines.append(f"| {seed} | rc {one.get('rc')} | rc {mt.get('rc')} | - | - |")
            ok = False
            continue
        a, b = one["evals"], mt["evals"]
        gap = b[-1][1] - a[-1][1]
        ok &= gap >= 0.05
        lm, mm = mt["last"], mt.get("mean", {})
        lines.append(f"| {seed} | {a[0][1]:.3f} -> {a[-1][1]:.3f} | {b[0][1]:.3f} -> {b[-1][1]:.3f} | {gap:+.3f} | "
                     + ", ".join(f"{lm.get(k, 0):.2f} ({mm.get(k, 0):.2f})" for k in ("turns_mean", "tool_use_frac", "revision_gain"))
                     + " |")
    lines.append(f"\n{STEPS} GRPO steps, held-out greedy accuracy every {EVAL_EVERY}; bar (+0.05 on every seed): "
                 f"{'met' if ok else 'NOT met'}")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(seeds), figsize=(4 * len(seeds), 3.2), squeeze=False)
        for ax, seed in zip(axes[0], seeds):
            for r, style in zip(RECIPES, ("-o", "-s")):
                ev = results.get(f"{r}-s{seed}", {}).get("evals", [])
                ax.plot([e[0] for e in ev], [e[1] for e in ev], style, label=r)
            ax.set_title(f"seed {seed}")
            ax.set_xlabel("GRPO step")
            ax.set_ylabel("held-out greedy accuracy")
            ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "tiny_turns.png", dpi=110)
    except ImportError:
        pass
    print(f"results: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
