"""Step metrics: scalars only, to metrics.jsonl always, the console and W&B when asked.

Invariant: every value logged is a Python float or int. A list (one value per rank, as the
seed system logged grad_norm) is refused loudly instead of being written.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from config import layout


class MetricError(TypeError):
    pass


def as_scalar(key: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and getattr(value, "numel", lambda: getattr(value, "size", 1))() == 1:
        return float(value.item())
    raise MetricError(f"metric {key!r} is not a scalar: {type(value).__name__} {str(value)[:80]}")


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: as_scalar(k, v) for k, v in metrics.items()}


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, console: bool = True, wandb_cfg: dict | None = None,
                 run_config: dict | None = None, log=None):
        self.path = layout.metrics_file(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)
        self.console = console
        self.log = log
        self.wandb = None
        if wandb_cfg and wandb_cfg.get("enabled"):
            try:
                import wandb

                self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity") or None,
                                        name=wandb_cfg.get("name"), config=run_config, dir=str(run_dir))
            except ImportError:
                if log:
                    log.warning("wandb requested but not installed; metrics go to metrics.jsonl only")

    def log_step(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        row = scalars(metrics)
        record = {"step": step, "time": time.time(), **{k: (None if math.isnan(v) else v) for k, v in row.items()}}
        self.file.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        return row

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = layout.metrics_file(run_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
