"""Our side of the peer bench: the warm-started export both sides start from, our run from it, and what
its own logs and metrics say about where the time went.

Invariants:
- The export is made by the launcher itself: tiny with its warm start (model.tiny_sft_steps supervised
  steps), then one GRPO step at learner.lr=1e-30 (validation refuses 0) and no evaluation; the step's
  Adam update is at most ~1e-29 per weight, below float32's resolution for every non-zero weight, so
  hf/step_1 holds the warm-started weights. (`coordinator.steps=0` exports nothing today.)
- Our run starts from that export through the launcher's documented reuse: a run directory whose
  model/ already holds a config and a tokenizer is not rebuilt (tasks.tiny_model.build_tiny), nor is a
  data/ that holds train.json; with model.tiny_sft_steps=0 there is no warm start. Prompts are then
  rendered from the same tokenizer and data as the export's run: tiny's compact prompts.
- The TRL side's prompts are the launcher's own (launch.run.load_prompts) in the coordinator's order
  (actors.coordinator.cursor.DataCursor with data.shuffle_seed), prompts_per_step per step.
- Timings come from the run's own files: metrics.jsonl rows (their `time` and time_* scalars) and the
  structlog JSON lines' timestamps under logs/, on the same clock as the bench's spawn time.
"""
from __future__ import annotations

import datetime as dt
import json
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = "tiny"
EXPORT_LR = "1e-30"


PACKAGES = ("actors", "config", "launch", "observe", "policies", "queues", "tasks", "weights")  # pyproject's


def compile_sources() -> int:
    """Byte-compiles the project's packages (what Python writes on a first import unless PYTHONDONTWRITEBYTECODE
    is set; then every actor process compiled ~100 modules again: ~5 CPU-s on the path to the first step).
    Returns how many packages compiled cleanly."""
    import compileall

    return sum(bool(compileall.compile_dir(str(REPO / p), quiet=2)) for p in PACKAGES)


def launcher(run_root: Path, run_id: str, overrides: list[str], recipe: str = RECIPE) -> list[str]:
    return [sys.executable, "-m", "launch.cluster", recipe, f"run_root={run_root}", f"run_id={run_id}", *overrides]


def export_command(run_root: Path, sft_steps: int | None = None) -> list[str]:
    """tiny's warm start, then one step at lr 1e-30: hf/step_1 is the warm-started model."""
    extra = [f"model.tiny_sft_steps={sft_steps}"] if sft_steps is not None else []
    return launcher(run_root, "warm", ["coordinator.steps=1", f"learner.lr={EXPORT_LR}", "coordinator.eval_every=0",
                                       "coordinator.checkpoint_every=0", *extra])


def warm_export(run_root: Path) -> Path:
    return run_root / "warm" / "hf" / "step_1"


def prepare_run_dir(run_root: Path, run_id: str) -> Path:
    """<run_root>/<run_id> with model/ = the warm export and data/ = the export run's task."""
    from config import layout

    src = run_root / "warm"
    run_dir = run_root / run_id
    if run_dir.exists():
        shutil.rmtree(run_dir)
    shutil.copytree(warm_export(run_root), layout.model_dir(run_dir))
    shutil.copytree(layout.data_dir(src), layout.data_dir(run_dir))
    return run_dir


def run_command(run_root: Path, run_id: str, steps: int, extra: list[str]) -> list[str]:
    return launcher(run_root, run_id, ["model.tiny_sft_steps=0", f"coordinator.steps={steps}", *extra])


def final_export(run_dir: Path) -> Path | None:
    from launch.export import latest_export

    return latest_export(run_dir)


def recipe_config(overrides: list[str] | None = None, recipe: str = RECIPE):
    from config import apply_overrides
    from config.recipes import get_recipe

    return apply_overrides(get_recipe(recipe), list(overrides or []))


def prompts_in_order(run_dir: Path, steps: int, overrides: list[str] | None = None, recipe: str = RECIPE) -> list[dict]:
    """The training prompts our coordinator takes, step by step: the launcher's rendering, the
    coordinator's cursor. One dict per prompt: text, ids, db_path, gold_sql, prompt_id, step."""
    import logging

    from actors.coordinator.cursor import DataCursor
    from config import layout
    from launch.run import load_prompts
    from queues.messages import unpack_ids

    cfg = recipe_config(overrides, recipe)
    log = _NullLog(logging.getLogger("bench.peers"))
    items, _ = load_prompts(cfg, str(layout.model_dir(run_dir)), str(layout.data_dir(run_dir)), log)
    cursor = DataCursor(len(items), cfg.data.shuffle_seed)
    per = cfg.coordinator.prompts_per_step
    out = []
    for step in range(steps):
        for k in cursor.take(per):
            it = items[k]
            out.append({"step": step, "prompt_id": it.prompt_id, "prompt": it.prompt_text,
                        "prompt_ids": unpack_ids(it.prompt_tokens).tolist(), "db_path": it.db_path,
                        "gold_sql": it.gold_sql})
    return out


class _NullLog:
    def __init__(self, logger):
        self.logger = logger

    def info(self, *a, **k):
        pass


# -- reading a run ------------------------------------------------------------------------------


def _ts(s: str) -> float:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def log_events(run_dir: Path) -> list[tuple[float, str, str, dict]]:
    """(time, actor file, event, fields) of every structlog line of the run, in time order."""
    out = []
    for f in sorted((run_dir / "logs").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "timestamp" in row and "event" in row:
                out.append((_ts(row["timestamp"]), f.stem, row["event"], row))
    return sorted(out, key=lambda e: e[0])


def metrics_rows(run_dir: Path) -> list[dict]:
    from config import layout

    path = layout.metrics_file(run_dir)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def step_times(rows: list[dict]) -> list[float]:
    """Wall time of each training step's metrics row (`time`), step >= 0, in order."""
    return [r["time"] for r in rows if r.get("step", -1) >= 0]


def timeline(step_end: list[float], start: float, samples_per_step: int) -> dict[str, float]:
    """The numbers of the table from the wall times at which each step ended (either side)."""
    if not step_end:
        return {}
    gaps = [b - a for a, b in zip(step_end, step_end[1:])]
    med = statistics.median(gaps) if gaps else step_end[0] - start
    return {"steps": float(len(step_end)), "first_step_s": step_end[0] - start,
            "s_per_step_median": med, "samples_per_s_step": samples_per_step / med if med > 0 else 0.0,
            "loop_s": step_end[-1] - step_end[0],
            "samples_per_s_loop": samples_per_step * (len(step_end) - 1) / (step_end[-1] - step_end[0])
            if len(step_end) > 1 and step_end[-1] > step_end[0] else 0.0}


# Phases before the first step, by the first log line that ends each (actor file, event).
START_MARKS = [
    ("launcher", "prompts", "config, task, model and tokenizer ready, prompts rendered"),
    ("launcher", "run started", "Redis + Ray start (ray.init)"),
    ("scorer-0", "scorer.started", "first actor up (scorer)"),
    ("learner", "learner.ready", "learner built (DeepSpeed engine, model)"),
    ("generator-0", "generator.started", "generator up (engine, model)"),
    ("launcher", "warm-start", "warm start (first logged fifth)"),
    ("coordinator", "warm-start done", "warm start done"),
    ("coordinator", "eval", "initial held-out eval done"),
    ("coordinator", "step", "first step done"),
]


def startup_profile(run_dir: Path, start: float, spawned: list[tuple[float, int, str]] | None = None) -> list[dict]:
    """Seconds after the command's start at which each start-up mark was logged (present ones only),
    with the gap since the previous mark, plus the first appearance of Redis and Ray's processes."""
    events = log_events(run_dir)
    marks = []
    for actor, event, label in START_MARKS:
        t = next((e[0] for e in events if e[1] == actor and e[2] == event), None)
        if t is not None:
            marks.append({"at_s": round(t - start, 2), "what": label, "source": f"{actor}: {event}"})
    for name, label in (("redis-server", "redis-server process appears"), ("gcs_server", "Ray GCS process appears"),
                        ("raylet", "raylet process appears"), ("default_worker", "first Ray worker process appears")):
        hit = next((s for s in spawned or [] if name in s[2]), None)
        if hit is not None:
            marks.append({"at_s": hit[0], "what": label, "source": "process tree"})
    return with_gaps(marks)


def with_gaps(marks: list[dict]) -> list[dict]:
    """Sorted by time, each with the seconds since the previous mark (`gap_s`)."""
    marks.sort(key=lambda m: m["at_s"])
    prev = 0.0
    for m in marks:
        m["gap_s"] = round(m["at_s"] - prev, 2)
        prev = m["at_s"]
    return marks


STEP_PARTS = ["time_generation", "time_generator_sleep", "time_learner_wake", "time_exposed_scoring", "time_training",
              "time_learner_sleep", "time_generator_wake_weights", "time_weight_sync", "time_generator_wake_kv",
              "time_step", "time_eval", "time_checkpoint"]


def step_profile(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per step: median and total of each time_* part, and of what lies between steps outside run_step
    (the gap between consecutive rows less time_step: evals, checkpoints, publishing, logging)."""
    steps = [r for r in rows if r.get("step", -1) >= 0]
    out: dict[str, dict[str, float]] = {}
    for k in STEP_PARTS:
        vals = [float(r[k]) for r in steps if r.get(k) is not None]
        if vals:
            out[k] = {"median": statistics.median(vals), "total": sum(vals), "n": float(len(vals))}
    between = [b["time"] - a["time"] - float(b.get("time_step") or 0.0) for a, b in zip(steps, steps[1:])]
    if between:
        out["between_steps"] = {"median": statistics.median(between), "total": sum(between), "n": float(len(between))}
    return out


def ours_numbers(run_dir: Path, start: float, samples_per_step: int) -> dict:
    rows = metrics_rows(run_dir)
    out = timeline(step_times(rows), start, samples_per_step)
    last = [r for r in rows if r.get("eval_accuracy") is not None]
    if last:
        out["train_eval_accuracy_last"] = last[-1]["eval_accuracy"]
        out["train_eval_reward_last"] = last[-1].get("eval_reward_mean")
    return out
