"""The console's step lines, read from the run's metrics.jsonl as the coordinator writes it.

    step  45/100  reward 0.183  acc 0.125  len  31.2  trained  12/16   5.1s  ETA 4m41s  held-out 0.201

Invariants: one line per metrics row, printed once (the caller keeps `seen`); the ETA is the mean
step time of the rows printed by this launch times the steps left (none before the first step);
the held-out reward is the latest one measured (sampled eval reward, else greedy accuracy), shown on
every later line, so a user always sees the headline number without scrolling. `summary` is the run's
last line: the held-out numbers of its first and last evaluations, before -> after.
"""
from __future__ import annotations

import json
from pathlib import Path

from config import layout


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, seen: int = 0):
        self.path = layout.metrics_file(run_dir)
        self.total = int(total_steps)
        self.seen = seen
        self.step_times: list[float] = []
        self.held_out: str = ""

    def lines(self) -> list[str]:
        """The lines for rows written since the last call."""
        if not self.path.exists():
            return []
        rows = self.path.read_text().splitlines()
        out = []
        for line in rows[self.seen:]:
            if not line.strip():
                continue
            out.append(self.line(json.loads(line)))
        self.seen = len(rows)
        return [x for x in out if x]

    def _held_out(self, row: dict) -> None:
        if row.get("eval_reward_mean") is not None:
            self.held_out = f"held-out reward {row['eval_reward_mean']:.3f}"
        elif row.get("eval_accuracy") is not None:
            self.held_out = f"held-out acc {row['eval_accuracy']:.3f}"

    def line(self, row: dict) -> str:
        if row.get("step", 0) < 0:  # the evaluation before training
            self._held_out(row)
            return (f"eval  accuracy {row.get('eval_accuracy') or 0:.3f}  held-out reward "
                    f"{row.get('eval_reward_mean') or 0:.3f}")
        self._held_out(row)
        step = int(row["step"]) + 1
        self.step_times.append(float(row.get("time_step") or 0.0))
        left = max(0, self.total - step)
        eta = sum(self.step_times) / len(self.step_times) * left
        width = len(str(self.total))
        return (f"step {step:>{width}}/{self.total}  reward {row.get('reward_mean') or 0:.3f}  "
                f"acc {row.get('accuracy') or 0:.3f}  len {row.get('response_len_mean') or 0:5.1f}  "
                f"trained {int(row.get('prompts_trained') or 0):>3}/{int(row.get('prompts') or 0)}  "
                f"{row.get('time_step') or 0:5.1f}s  ETA {_duration(eta)}"
                + (f"  {self.held_out}" if self.held_out else ""))

    def print_new(self) -> None:
        for line in self.lines():
            print(line, flush=True)


def summary(run_dir: Path) -> str:
    """'held-out: reward 0.201 -> 0.358, greedy accuracy 0.250 -> 0.432 (evals at steps -1 and 99)',
    from the first and last metrics rows that carry held-out numbers ("" when none do)."""
    path = layout.metrics_file(run_dir)
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    evals = [r for r in rows if r.get("eval_reward_mean") is not None or r.get("eval_accuracy") is not None]
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    parts = [f"{label} {_num(first.get(key))} -> {_num(last.get(key))}"
             for key, label in (("eval_reward_mean", "reward"), ("eval_accuracy", "greedy accuracy"))
             if first.get(key) is not None or last.get(key) is not None]
    return f"held-out: {', '.join(parts)} (evals at steps {first.get('step')} and {last.get('step')})"


def _num(x) -> str:
    return "n/a" if x is None else f"{float(x):.3f}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
