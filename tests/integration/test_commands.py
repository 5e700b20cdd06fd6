"""The commands a run prints for the user (launch/commands.py, launch/export.next_steps): each one,
pasted as printed, reaches its module's own checks, and the run's summary line reads before -> after."""
import json
import shlex
import subprocess
import sys

from launch.commands import command, python
from launch.export import next_steps
from launch.progress import summary
from tasks.synthetic import write_dataset


def test_python_is_this_interpreter_and_quoting_survives_spaces(tmp_path):
    assert subprocess.run([python(), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                          check=True).stdout.strip() == sys.prefix  # the venv, not the base interpreter
    assert shlex.split(command("launch.report", tmp_path / "a run"))[-1] == str(tmp_path / "a run")


def test_every_printed_command_parses_and_runs(tmp_path):
    bird = write_dataset(tmp_path / "bird data", num_databases=1, num_questions=6, seed=0)
    run = tmp_path / "my run"
    export = run / "hf" / "step_3"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text(json.dumps({"step": -1, "eval_accuracy": 0.25, "eval_reward_mean": 0.2}) + "\n"
                                       + json.dumps({"step": 0, "reward_mean": 0.3, "eval_accuracy": 0.5}) + "\n")
    lines = dict(line.split(":", 1) for line in next_steps(run, bird, "dev").strip().splitlines())
    assert set(lines) == {"evaluate", "serve", "export"} and lines["export"].strip() == str(export)
    # a value that fails the module's own check after argparse accepted every printed argument: exit 2
    # with that check's message, never argparse's "usage:" (an unknown flag or a missing required one)
    for name, extra, message in (("evaluate", ["--timeout", "0"], "--timeout must be > 0"),
                                 ("serve", ["--replicas", "0"], "--replicas and --max-batch-size")):
        argv = shlex.split(lines[name]) + extra
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "usage:" not in proc.stderr, (name, proc.stderr)
    proc = subprocess.run(shlex.split(command("launch.report", run)) + ["--out", str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "r.png").is_file(), proc.stderr


def test_summary_line_is_before_and_after(tmp_path):
    assert summary(tmp_path) == ""
    rows = [{"step": -1, "eval_accuracy": 0.25, "eval_reward_mean": 0.2}, {"step": 0, "reward_mean": 0.3},
            {"step": 9, "eval_accuracy": 0.5, "eval_reward_mean": 0.35}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summary(tmp_path) == ("held-out: reward 0.200 -> 0.350, greedy accuracy 0.250 -> 0.500 "
                                 "(evals at steps -1 and 9)")
