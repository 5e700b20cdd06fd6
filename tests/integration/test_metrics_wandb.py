"""MetricsLogger with W&B in offline mode (WANDB_MODE=offline, nothing leaves the machine): the run's
files exist after close() (wandb.finish) and its history records hold the logged scalars."""
import json
import re
import time
from pathlib import Path

import pytest

from observe.metrics import MetricError, MetricsLogger


def _history(wandb_file: Path, key: str) -> list[float]:
    """Values of `key` in the run's history records (protobuf HistoryItem: key, then value_json)."""
    data = wandb_file.read_bytes()
    out = []
    for m in re.finditer(re.escape(key.encode()) + rb"\x82\x01(.)", data, re.S):
        n = m.group(1)[0]
        out.append(json.loads(data[m.end():m.end() + n]))
    return out


def test_offline_wandb_run_holds_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, console=False, wandb_cfg={"enabled": True, "project": "arl-test", "name": "t"},
                           run_config={"learner": {"lr": 1e-6}})
    assert logger.wandb is not None
    for step in range(3):
        logger.log_step(step, {"reward_mean": 0.25 * step, "grad_norm": 1.5})
    with pytest.raises(MetricError):
        logger.log_step(3, {"grad_norm": [1.0, 2.0]})  # a per-rank list is refused, never logged
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # wandb's own service process may still be flushing the file when finish() returns (seen on a loaded
    # machine: the history empty at once, whole a moment later); wait for it, bounded.
    deadline = time.monotonic() + 30
    while sorted(set(_history(runs[0], "reward_mean"))) != [0.0, 0.25, 0.5] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(set(_history(runs[0], "reward_mean"))) == [0.0, 0.25, 0.5]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [0.0, 0.25, 0.5]
