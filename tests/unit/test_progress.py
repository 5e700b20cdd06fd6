"""The console's step lines: step k/N, an ETA from this launch's step times, the latest held-out reward."""
import json

from launch.progress import Progress


def test_step_lines_count_steps_show_eta_and_the_latest_held_out_reward(tmp_path):
    rows = [{"step": -1, "eval_accuracy": 0.15, "eval_reward_mean": 0.12},
            {"step": 0, "reward_mean": 0.2, "accuracy": 0.1, "prompts": 16, "prompts_trained": 12, "time_step": 10.0},
            {"step": 1, "reward_mean": 0.3, "accuracy": 0.2, "prompts": 16, "prompts_trained": 11, "time_step": 20.0,
             "eval_accuracy": 0.2, "eval_reward_mean": 0.25}]
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    p = Progress(tmp_path, total_steps=100)
    assert p.lines() == ["eval  accuracy 0.150  held-out reward 0.120"]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[1:]))
    first, second = p.lines()
    assert first.startswith("step   1/100  reward 0.200") and "trained  12/16" in first
    assert "ETA 16m30s" in first and first.endswith("held-out reward 0.120")  # 99 steps x 10 s
    assert "step   2/100" in second and "ETA 24m30s" in second and second.endswith("held-out reward 0.250")
    assert p.lines() == []  # each row printed once
