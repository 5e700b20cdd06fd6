"""bench/gpu/recipe.py's and bench/gpu/recipe_async.py's summaries read from a run's files (metrics.jsonl, the
launcher's and the coordinator's JSON logs): written here as a run writes them, no device needed."""
import json

from bench.gpu import recipe as gpu_recipe
from bench.gpu import recipe_async as gpu_async


def write_run(run_dir, rows, launcher, coordinator):
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "logs" / "launcher.jsonl").write_text("".join(json.dumps(e) + "\n" for e in launcher) + "not json\n")
    (run_dir / "logs" / "coordinator.jsonl").write_text("".join(json.dumps(e) + "\n" for e in coordinator))


def test_the_summary_carries_the_start_up_memory_marks_the_warm_start_and_the_parked_requests(tmp_path):
    rows = [{"step": -1, "eval_accuracy": 0.3, "eval_reward_mean": 0.25, "time": 10.0}]
    rows += [{"step": s, "time": 20.0 + 3 * s, "time_step": 2.0, "samples_per_s": 40.0 + s, "interrupted_requests": 4.0 * s}
             for s in range(4)]
    rows += [{"step": 3, "eval_accuracy": 0.5, "eval_reward_mean": 0.45, "time": 31.0}]
    launcher = [{"event": "start-up memory", "phase": "learner built", "device_used_gib": 9.07,
                 "learner_max_reserved_gib": 8.6, "timestamp": "t", "level": "info"},
                {"event": "start-up memory", "phase": "engines built", "device_used_gib": 43.9,
                 "learner_max_reserved_gib": 0.7, "engine_reserved_gib": 42.0},
                {"event": "actors stopped", "alive": 0}]
    coordinator = [{"event": "warm-start done", "time_sft": 100.0, "time_sft_learner": 90.0, "sft_step_s": 0.25,
                    "sft_calls": 20.0}]
    write_run(tmp_path, rows, launcher, coordinator)
    out = gpu_recipe.summarize(tmp_path, [], "")
    assert out["reward_rise"] == 0.2 and out["greedy_rise"] == 0.2 and out["actors_alive_after"] == 0
    assert [m["phase"] for m in out["startup_memory"]] == ["learner built", "engines built"]
    assert out["startup_memory"][1]["engine_reserved_gib"] == 42.0
    assert out["startup_line"] == ("learner built 9.07 (learner peak 8.6, engine ?) / "
                                   "engines built 43.9 (learner peak 0.7, engine 42.0)")
    assert (out["sft_s"], out["sft_learner_s"], out["sft_step_s"], out["sft_calls"]) == (100.0, 90.0, 0.25, 20.0)
    assert out["step_samples_per_s"] == 42.0  # the median over steps 2..N (steps 1-3)
    assert gpu_async.parked_per_step(tmp_path) == 8.0  # steps 1..3 parked 4, 8, 12
    assert gpu_async.parked_per_step(tmp_path / "none") is None


def test_the_summary_carries_the_bytes_per_sync_over_steps_2_to_n_and_the_learner_s_trained_params(tmp_path):
    mib = 2 ** 20
    rows = [{"step": 0, "time": 10.0, "time_step": 2.0, "weight_sync_bytes": 700.0 * mib},  # the base too
            {"step": 1, "time": 13.0, "time_step": 2.0, "weight_sync_bytes": 16.0 * mib},
            {"step": 2, "time": 16.0, "time_step": 2.0, "weight_sync_bytes": float("nan")},  # synced nothing
            {"step": 3, "time": 19.0, "time_step": 2.0, "weight_sync_bytes": 17.0 * mib}]
    write_run(tmp_path, rows, [], [])
    (tmp_path / "logs" / "learner.jsonl").write_text(json.dumps({"event": "learner.ready", "trainable_params": 65536}) + "\n")
    out = gpu_recipe.summarize(tmp_path, [], "")
    assert out["sync_mib"] == 16.5 and out["trainable_params"] == 65536
    (tmp_path / "logs" / "learner.jsonl").unlink()
    assert gpu_recipe.summarize(tmp_path, [], "")["trainable_params"] is None
