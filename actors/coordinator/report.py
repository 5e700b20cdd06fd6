"""Where the coordinator's metrics go: the run's metrics.jsonl (and W&B), Ray's metrics, the coordinator's log.

Invariants:
- Every value reported is a scalar (a step's metrics are a flat dict of floats).
- Nothing is kept: a step's metrics are written and forgotten (tests/integration/test_memory_bounds.py).
- Each phase of a step's handshake and of the run's end is one `phase` line in the coordinator's log.
- The metrics file is opened inside the actor (`attach`: the launcher asks once it is placed) and closed
  (flushed, wandb.finish() when W&B is on) when the run's loop ends.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from config import RunConfig
from observe.ray_metrics import export as export_ray_metrics


class StepReport:
    """A step's and an evaluation's metrics, written where they go."""

    def __init__(self, cfg: RunConfig, run_id: str, run_dir: Path, log: Any = None, metrics_logger: Any = None):
        self.cfg, self.run_id, self.run_dir, self.log, self.metrics_logger = cfg, run_id, run_dir, log, metrics_logger

    def attach(self) -> None:
        """Inside the actor: the run's metrics.jsonl (and W&B when logging.wandb is on)."""
        from observe.metrics import MetricsLogger

        lc = self.cfg.logging
        self.metrics_logger = MetricsLogger(str(self.run_dir), console=lc.console, run_config=msgspec.to_builtins(self.cfg),
                                            wandb_cfg={"enabled": lc.wandb, "project": lc.wandb_project,
                                                       "entity": lc.wandb_entity, "name": self.run_id})

    def step(self, step: int, m: dict[str, float]) -> None:
        if self.metrics_logger is not None:
            self.metrics_logger.log_step(step, m)
        export_ray_metrics("coordinator", m)
        if self.log is not None:
            self.log.info("step", step=step, reward=round(m.get("reward_mean", 0), 3),
                          accuracy=round(m.get("accuracy", 0), 3), eval=m.get("eval_accuracy"),
                          time_s=round(m["time_step"], 1), trained=int(m.get("prompts_trained", 0)),
                          dropped=int(m["prompts"] - m.get("prompts_trained", 0)))

    def phase(self, step: int, phase: str, **kw: Any) -> None:
        """One line in the coordinator's log as a step's handshake or the run's end passes a phase: when a
        run stops answering, its last line names what was waited for next (the GPU run of 2026-12-05)."""
        if self.log is not None:
            self.log.info("phase", step=step, phase=phase, **kw)

    def eval(self, step: int, result: dict[str, float]) -> None:
        """An evaluation before any step (after one, its metrics join the step's)."""
        if result and self.metrics_logger is not None:
            self.metrics_logger.log_step(-1, result)
        if result and self.log is not None:
            self.log.info("eval", step=step, **{k: round(v, 3) for k, v in result.items()})

    def close(self) -> None:
        if self.metrics_logger is not None:
            self.metrics_logger.close()  # flushes metrics.jsonl; wandb.finish() when W&B is on
            self.metrics_logger = None
