"""The coordinator's checkpoints: DeepSpeed state + the data cursor + the ledger, then the HF export.

A mixin of `actors.coordinator.coordinator.Coordinator`. It uses the coordinator's `cfg`, `run_dir`, `run_id`,
`learner`, `step`, `version`, `cursor`, `ledger`, `train_items`, `log` and its bounded calls
(actors/coordinator/bounds.py).

Invariants:
- A checkpoint holds the learner's state and the cursor where the next step starts (step, version,
  epoch, position), so a resumed run continues at the next step with the same data order.
- Order on disk: learner state, coordinator.json, the HF export (renamed into place whole), then the
  `latest` marker, then pruning, which never removes the latest checkpoint.
- Resuming gives the generators the checkpoint's weights before any prompt is published.
"""
from __future__ import annotations

import json
from pathlib import Path

from actors.coordinator.cursor import DataCursor
from config import layout
from queues.messages import is_eval_task, task_step


class Checkpointing:
    """save_checkpoint / export_hf / latest_checkpoint / resume_from for the Coordinator."""

    def checkpoint_dir(self, step: int) -> Path:
        return layout.checkpoint_dir(self.run_dir, step)

    async def save_checkpoint(self, step: int) -> Path:
        """DeepSpeed checkpoint + cursor, then the HF export of the same weights (hf/step_<step+1>),
        then the `latest` marker, then pruning (actors/coordinator/export.py: never the latest checkpoint)."""
        from actors.coordinator.export import prune_checkpoints, prune_exports, write_atomic

        path = self.checkpoint_dir(step)
        path.mkdir(parents=True, exist_ok=True)
        await self._learner("save", str(path / "learner"))
        # The cursor where step+1 starts: the next step's prompts may already be published
        # (taken from the cursor) when this checkpoint is written; a resume must take them again.
        cursor = getattr(self, "_cursor_before", {}).get(step + 1, self.cursor.state())
        state = {"step": step, "version": self.version, "cursor": cursor,
                 "outcomes": count_outcomes(self.ledger.values()), "ledger": self.ledger,
                 "resyncs": getattr(self, "resyncs", 0), "frozen_restarts": getattr(self, "frozen_restarts", 0)}
        write_atomic(path / "coordinator.json", json.dumps(state))
        await self.export_hf(step + 1)
        write_atomic(layout.latest_marker(self.run_dir), path.name)
        pruned = prune_checkpoints(layout.checkpoints_dir(self.run_dir), self.cfg.coordinator.keep_checkpoints)
        pruned += prune_exports(layout.exports_dir(self.run_dir), self.cfg.coordinator.keep_exports)
        if pruned and self.log is not None:
            self.log.info("checkpoints pruned", removed=[f"{p.parent.name}/{p.name}" for p in pruned],
                          keep=self.cfg.coordinator.keep_checkpoints, keep_exports=self.cfg.coordinator.keep_exports)
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
        await self._learner("export_hf", str(tmp))
        commit_export(tmp, final, inference_settings(self.cfg, self.run_id, steps_done),
                      source_model_dir(self.cfg, self.run_dir))
        return final

    @staticmethod
    def latest_checkpoint(run_dir: Path) -> Path | None:
        marker = layout.latest_marker(run_dir)
        if not marker.exists():
            return None
        path = marker.parent / marker.read_text().strip()
        return path if (path / "coordinator.json").exists() else None

    async def resume_from(self, path: Path) -> None:
        state = json.loads((path / "coordinator.json").read_text())
        await self._learner("load", str(path / "learner"))
        self.step = state["step"] + 1
        self.version = state["version"]
        c = state["cursor"]
        self.cursor = DataCursor(len(self.train_items), c["seed"], c["epoch"], c["position"])
        # Outcomes up to the checkpoint's step; later steps (lost with the crash) are redone.
        self.ledger = {t: o for t, o in state.get("ledger", {}).items()
                       if is_eval_task(t) or task_step(t) is None or task_step(t) <= state["step"]}
        # The generators start from the initial weights: give them the checkpoint's.
        await self._all_generators("wake", ["weights"])
        await self.sync_weights(self.version)
        await self._all_generators("set_version", self.version)
        await self._all_generators("wake", ["kv_cache"])


def count_outcomes(values) -> dict[str, int]:
    """Outcome -> how many tasks had it."""
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
