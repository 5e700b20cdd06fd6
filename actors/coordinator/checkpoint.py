"""The coordinator's checkpoints: DeepSpeed state + the coordinator's state (cursor, ledger), then the HF export.

`Checkpoints` is a component the coordinator holds (actors/coordinator/coordinator.py), built from what it
uses: the run's config, its id and directory, the learner's typed handle (actors/handles.py) and a log.
The coordinator hands it the state to save and applies the state it loads.

Invariants:
- A checkpoint holds the learner's state and the cursor where the next step starts (step, version,
  epoch, position), so a resumed run continues at the next step with the same data order.
- Order on disk: learner state, coordinator.json, the HF export (renamed into place whole), then what the
  caller must have written before this checkpoint can be resumed from (`before_latest`: the step's metrics
  row), then the `latest` marker, then pruning, which never removes the latest checkpoint. A death before the
  marker resumes from the previous checkpoint and redoes the step (its row again; the last one counts); a
  death after it never leaves a resumed run without the step's row.
- Resuming gives the generators the checkpoint's weights before any prompt is published (the coordinator's
  resume_from).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

from actors.coordinator.cursor import DataCursor
from actors.handles import LearnerHandle
from config import RunConfig, layout
from queues.messages import is_eval_task, task_step


class Saved(NamedTuple):
    """What a checkpoint gives the coordinator back: the step it ended, the version, the cursor, the ledger."""

    step: int
    version: int
    cursor: DataCursor
    ledger: dict[str, str]


class Checkpoints:
    """save / export_hf / latest / load of one run's checkpoints."""

    def __init__(self, cfg: RunConfig, run_id: str, run_dir: Path, learner: LearnerHandle, log: Any = None):
        self.cfg, self.run_id, self.run_dir, self.learner, self.log = cfg, run_id, Path(run_dir), learner, log

    def dir(self, step: int) -> Path:
        return layout.checkpoint_dir(self.run_dir, step)

    async def save(self, step: int, version: int, cursor: dict[str, int], ledger: dict[str, str],
                   before_latest: Callable[[], None] | None = None, **counters: int) -> Path:
        """DeepSpeed checkpoint + coordinator.json (step, version, the cursor where step+1 starts, the ledger
        and `counters`), then the HF export of the same weights (hf/step_<step+1>), then `before_latest()`,
        then the `latest` marker, then pruning (actors/coordinator/export.py: never the latest checkpoint)."""
        from actors.coordinator.export import prune_checkpoints, prune_exports, write_atomic

        state = {"step": step, "version": version, "cursor": cursor, "outcomes": count_outcomes(ledger.values()),
                 "ledger": ledger, **counters}
        path = self.dir(step)
        path.mkdir(parents=True, exist_ok=True)
        await self.learner.save(str(path / "learner"))
        write_atomic(path / "coordinator.json", json.dumps(state))
        await self.export_hf(step + 1)
        if before_latest is not None:
            before_latest()
        write_atomic(layout.latest_marker(self.run_dir), path.name)
        keep = self.cfg.coordinator
        pruned = prune_checkpoints(layout.checkpoints_dir(self.run_dir), keep.keep_checkpoints)
        pruned += prune_exports(layout.exports_dir(self.run_dir), keep.keep_exports)
        if pruned and self.log is not None:
            self.log.info("checkpoints pruned", removed=[f"{p.parent.name}/{p.name}" for p in pruned],
                          keep=keep.keep_checkpoints, keep_exports=keep.keep_exports)
        return path

    async def export_hf(self, steps_done: int) -> Path:
        """The learner writes a Hugging Face directory into a temp dir; it is renamed into place whole."""
        from actors.coordinator.export import (
            begin_export,
            commit_export,
            export_dir,
            inference_settings,
            source_model_dir,
        )

        final = export_dir(self.run_dir, steps_done)
        tmp = begin_export(final)
        await self.learner.export_hf(str(tmp))
        commit_export(tmp, final, inference_settings(self.cfg, self.run_id, steps_done),
                      source_model_dir(self.cfg, self.run_dir))
        return final

    @staticmethod
    def latest(run_dir: Path) -> Path | None:
        marker = layout.latest_marker(run_dir)
        if not marker.exists():
            return None
        path = marker.parent / marker.read_text().strip()
        return path if (path / "coordinator.json").exists() else None

    async def load(self, path: Path, num_items: int) -> Saved:
        """The learner's state loaded from `path`; the coordinator's saved beside it, its cursor over
        `num_items` training prompts, its ledger up to the checkpoint's step (later steps, lost with the
        crash, are redone)."""
        state = json.loads((path / "coordinator.json").read_text())
        await self.learner.load(str(path / "learner"))
        c, step = state["cursor"], state["step"]
        ledger = {t: o for t, o in state.get("ledger", {}).items()
                  if is_eval_task(t) or task_step(t) is None or task_step(t) <= step}
        return Saved(step, state["version"], DataCursor(num_items, c["seed"], c["epoch"], c["position"]), ledger)


def count_outcomes(values) -> dict[str, int]:
    """Outcome -> how many tasks had it."""
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
