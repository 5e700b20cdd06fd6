"""gpu1_0p6b colocated against async, or against LoRA, on its one GPU, back to back in one device call.

    python3 -m bench.gpu.recipe_async                  # H200, after shared/gpu/device-setup.sh: both modes, ~9 min
    FULL=1 MODES=async python3 -m bench.gpu.recipe_async  # the recipes as they are (40 steps, 500-step warm start):
                                                 # one mode a call (MODES=colocated, then MODES=async)
    MODES="lora colocated" python3 -m bench.gpu.recipe_async  # LoRA RL (gpu1_0p6b_lora) against full fine-tuning
    SMOKE=1 .venv/bin/python -m bench.gpu.recipe_async    # CPU: tiny colocated vs tiny async, 4 steps each (the plumbing)

Each mode is one launcher run, `python -m launch.cluster RECIPE seed=S run_root=... run_id=... EXTRA`, run by
bench/gpu/recipe.py's `run_seed` (a fresh launcher with its own Ray and embedded Redis; nvidia-smi sampled
every 200 ms; run_root outside $OUT):
    colocated   gpu1_0p6b         vLLM sleeps (level 2) while the learner trains; the learner sleeps
                                  while vLLM generates; CUDA-IPC weight sync every step
    async       gpu1_0p6b_async   the same card shared, nothing sleeps: the engine stays resident and
                                  generates step s+1 while step s trains (max_staleness 1), parks its
                                  requests at each update and continues them (partial rollouts), CUDA IPC,
                                  TIS at 2
    lora        gpu1_0p6b_lora    colocated with a rank-16 adapter the only trained parameters; each sync
                                  moves the adapter alone (the first also the warm-started base) by the
                                  object store into vLLM as a new LoRA adapter
To fit both runs in one call (the device's 10 minutes: each run also pays ~2 minutes of start-up, the task
and model built, the learner then the engine), EXTRA defaults to a shorter run of both recipes alike: a
200-step warm start (the recipe's 500 take ~165 s a run), 12 RL steps, held-out evaluation at steps 0, 6
and 12 (`coordinator.steps=12 coordinator.eval_every=6 model.tiny_sft_steps=200`); async runs first, so
the new path gets the fresh budget. FULL=1 runs the recipes unchanged (EXTRA empty): ~6 minutes a mode,
so one mode a call.

$OUT (rewritten after each mode, so a call cut short keeps the modes it finished):
    async.md / async.json   one row per mode: wall, steps, samples/s (whole step: trained samples / step
                            seconds; the figure that compares the modes), learner samples/s and tokens/s,
                            step / generation / training / weight-sync seconds (medians over steps 2..N),
                            held-out sampled reward and greedy accuracy before -> after, mismatch KL,
                            requests parked at updates (async), device memory (before step 1, steps 2..N),
                            the start-up memory marks, and the async/colocated ratio of samples/s
    runs.tar.gz             per mode: metrics.jsonl, config.json, logs/*.jsonl, console, mem.csv
Env: MODES ("async colocated"), SEED (0), EXTRA (see above; FULL=1: none), RUN_TIMEOUT_S (330 a mode; FULL: 480),
BUDGET_S (570: the whole call; a mode that would not fit is skipped and named), OUT (./bench_out), RUN_ROOT.
This process needs only the standard library (as bench/gpu/recipe.py). Exit 0 when every mode that ran exited 0.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.gpu import recipe as gr

SMOKE = gr.SMOKE
FULL = os.environ.get("FULL", "") not in ("", "0")
RECIPES = {"colocated": "tiny" if SMOKE else "gpu1_0p6b", "async": "tiny" if SMOKE else "gpu1_0p6b_async",
           "lora": "tiny_lora" if SMOKE else "gpu1_0p6b_lora"}
MODE_OVERRIDES = {"colocated": [], "async": ["coordinator.mode=async", "assembler.max_staleness=1"] if SMOKE else [],
                  "lora": []}
MODES = os.environ.get("MODES", "async colocated").split()  # the new path first: it gets the fresh budget
SEED = int(os.environ.get("SEED", "0"))
SHORT = "coordinator.steps=12 coordinator.eval_every=6 model.tiny_sft_steps=200"
EXTRA = os.environ.get("EXTRA", "" if FULL or SMOKE else SHORT).split()
RUN_TIMEOUT_S = float(os.environ.get("RUN_TIMEOUT_S", "480" if FULL else "330"))
BUDGET_S = float(os.environ.get("BUDGET_S", "570"))

COLUMNS = [("mode", "mode"), ("recipe", "recipe"), ("rc", "rc"), ("wall_s", "wall s"), ("steps", "steps"),
           ("step_samples_per_s", "samples/s (whole step)"), ("learner_samples_per_s", "learner samples/s"),
           ("learner_tokens_per_s", "learner tok/s"), ("step_s", "step s"), ("generation_s", "generation s"),
           ("training_s", "training s"), ("sync_s", "weight sync s"), ("reward_before", "held-out reward before"),
           ("reward_after", "after"), ("greedy_before", "greedy acc. before"), ("greedy_after", "after"),
           ("mismatch_kl", "mismatch KL"), ("interrupted_requests", "requests parked per step"),
           ("mem_before_step1_gib", "GiB before step 1"), ("mem_steps2_n_gib", "GiB steps 2..N"),
           ("sft_step_s", "warm-start s/step"), ("sync_mib", "MiB per sync (steps 2..N)"),
           ("trainable_params", "trained params"), ("startup_line", "start-up GiB by phase")]


def parked_per_step(run_dir: Path) -> float | None:
    """Median requests the engine parked at a weight update (async with partial rollouts), steps 2..N."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    vals = [r["interrupted_requests"] for r in rows if r.get("step", -1) >= 1 and "interrupted_requests" in r]
    return round(statistics.median(vals), 1) if vals else None


def write(results: list[dict], notes: list[str]) -> None:
    out = gr.OUT
    by = {r["mode"]: r for r in results}
    if "colocated" in by and "async" in by:
        a, c = by["async"].get("step_samples_per_s"), by["colocated"].get("step_samples_per_s")
        if a and c:
            notes = notes + [f"async / colocated samples/s (whole step): {a / c:.2f}"]
    (out / "async.json").write_text(json.dumps({"modes": MODES, "seed": SEED, "extra": EXTRA, "smoke": SMOKE,
                                                "results": results, "notes": notes}, indent=1))
    lines = [f"# gpu1_0p6b: {' vs '.join(MODES)}, seed {SEED}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", f"overrides (both modes): {' '.join((gr.SMOKE_OVERRIDES if SMOKE else []) + EXTRA) or '(none)'}", "",
             *gr.table(COLUMNS, results, notes)]
    (out / "async.md").write_text("\n".join(lines) + "\n")
    gr.pack_runs(out / "runs.tar.gz", results)


def main() -> int:
    unknown = [m for m in MODES if m not in RECIPES]
    if unknown:
        print(f"error: MODES: unknown mode(s) {unknown}; known: {list(RECIPES)}", file=sys.stderr)
        return 2
    gr.OUT.mkdir(parents=True, exist_ok=True)
    gr.RUN_ROOT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: list[dict] = []
    notes: list[str] = []
    for mode in MODES:
        left = BUDGET_S - (time.time() - t0)
        if left < 120.0:
            notes.append(f"mode {mode} not run: {left:.0f} s of BUDGET_S={BUDGET_S:g} left (run it in its own call: "
                         f"MODES={mode})")
            break
        r = gr.run_seed(SEED, min(RUN_TIMEOUT_S, left), recipe=RECIPES[mode], extra=[*MODE_OVERRIDES[mode], *EXTRA],
                        tag=f"-{mode}")
        r["mode"] = mode
        r["interrupted_requests"] = parked_per_step(gr.KEEP / r["run_id"])
        results.append(r)
        write(results, notes)
    write(results, notes)
    print((gr.OUT / "async.md").read_text(), flush=True)
    return 0 if results and all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
