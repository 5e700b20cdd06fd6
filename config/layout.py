"""A run directory's layout, in one place: every path the launcher, the actors and the tools read or write.

    <run_root>/<run_id>/
        config.json          the validated config (no `auto`), written once at start
        metrics.jsonl        one row of scalars per step (observe/metrics.py)
        logs/<name>.jsonl    one JSON log per process (observe/logs.py)
        checkpoints/step_<NNNNNN>/{learner/, coordinator.json}, checkpoints/latest
        hf/step_<N>/         Hugging Face exports after N steps (actors/coordinator/export.py)
        model/               the tiny model built for model.source=tiny
        data/                the synthetic task for data.synthetic
        redis/               the embedded redis-server's socket and files

Invariants: pure path arithmetic (nothing is created or read here, nothing of ours is imported);
every function takes the run directory and returns a Path under it.
"""
from __future__ import annotations

from pathlib import Path

CONFIG, METRICS, LOGS, CHECKPOINTS, EXPORTS, MODEL, DATA, REDIS = (
    "config.json", "metrics.jsonl", "logs", "checkpoints", "hf", "model", "data", "redis")
LATEST = "latest"  # the marker file naming the newest complete checkpoint


def config_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONFIG


def metrics_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def logs_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOGS


def log_file(run_dir: str | Path, name: str) -> Path:
    return logs_dir(run_dir) / f"{name}.jsonl"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{int(step):06d}"


def latest_marker(run_dir: str | Path) -> Path:
    return checkpoints_dir(run_dir) / LATEST


def exports_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / EXPORTS


def export_dir(run_dir: str | Path, steps_done: int) -> Path:
    return exports_dir(run_dir) / f"step_{int(steps_done)}"


def model_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / MODEL


def data_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DATA


def redis_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REDIS
