"""launch.report: metrics.jsonl -> PNG, with one-line errors for missing or empty files."""
import json

import pytest

from launch.report import ReportError, main, panels_for, write_report
from tests.builders import synthetic_rows, write_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_writes_a_valid_png_and_prints_its_path(tmp_path, capsys):
    write_metrics(tmp_path / "run", synthetic_rows())
    out = tmp_path / "plots" / "r.png"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_default_output_is_in_the_run_dir(tmp_path):
    write_metrics(tmp_path, synthetic_rows(3))
    assert write_report(tmp_path) == tmp_path / "report.png"
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_panels_skip_missing_keys_and_collect_timings():
    rows = [{"step": 0, "time": 0.0, "accuracy": 0.5, "time_score": 1.0, "time_train": None},
            {"step": 1, "time": 1.0, "accuracy": None, "time_score": 2.0, "time_train": 3.0}]
    panels = {title: keys for title, keys, _ in panels_for(rows)}
    assert panels == {"accuracy": ["accuracy"], "stage timings": ["time_score", "time_train"]}
    full = {title: keys for title, keys, _ in panels_for(synthetic_rows())}
    assert full["reward"] == ["reward_mean"] and full["accuracy"] == ["eval_accuracy", "accuracy"]


def test_held_out_reward_is_plotted_smoothing_and_step_count():
    from launch.report import smoothed, training_steps

    rows = [{"step": -1, "eval_reward_mean": 0.12}] + synthetic_rows(4) + [{"step": 3, "eval_reward_mean": 0.2}]
    panels = {title: keys for title, keys, _ in panels_for(rows)}
    assert panels["reward"] == ["eval_reward_mean", "reward_mean"]
    assert training_steps(rows) == 4  # 6 rows: the pre-training eval and a second row of step 3 are no steps
    assert smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_empty_or_missing_metrics_is_a_one_line_error_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is empty" in err and err.count("\n") == 1
    assert not (tmp_path / "report.png").exists()


def test_rows_without_plottable_keys_or_bad_json_are_errors(tmp_path):
    write_metrics(tmp_path, [{"step": 0, "time": 1.0, "loss": 0.3}])
    with pytest.raises(ReportError, match="has none of"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ReportError, match=":2: not JSON"):
        write_report(tmp_path)


def test_several_runs_make_one_comparison_labelled_by_seed(tmp_path, capsys):
    for seed in (0, 1, 2):
        write_metrics(tmp_path / f"s{seed}", [{"step": -1, "eval_reward_mean": 0.2, "eval_accuracy": 0.2}]
                      + [dict(r, eval_reward_mean=0.3 + seed / 10) for r in synthetic_rows()])
        (tmp_path / f"s{seed}" / "config.json").write_text(json.dumps({"seed": seed}))
    out = tmp_path / "seeds.png"
    assert main([str(tmp_path / f"s{seed}") for seed in (0, 1, 2)] + ["--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:8] == PNG_MAGIC
    from launch.report import _label

    dirs = [tmp_path / f"s{seed}" for seed in (0, 1, 2)]
    assert _label(tmp_path / "s1", dirs) == "seed 1" and _label(tmp_path / "s1", [tmp_path / "s1"]) == "s1"
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "config.json").write_text(json.dumps({"seed": 1, "generator": {"max_turns": 1}}))
    (tmp_path / "s1" / "config.json").write_text(json.dumps({"seed": 1, "generator": {"max_turns": 3}}))
    assert _label(tmp_path / "t1", dirs + [tmp_path / "t1"]) == "seed 1, max_turns 1"
    assert _label(tmp_path / "s1", [tmp_path / "s1", tmp_path / "t1"]) == "max_turns 3"


def test_many_timings_are_grouped_into_six_series_and_the_title_says_before_and_after(tmp_path):
    from launch.report import GROUP_PREFIX, with_timing_groups

    keys = ["time_step", "time_generation", "time_exposed_scoring", "time_training", "time_weight_sync",
            "time_generator_sleep", "time_generator_wake_kv", "time_learner_wake", "time_eval", "time_checkpoint",
            "time_generator_pause", "time_learner_sleep"]
    rows = [{"step": -1, "eval_accuracy": 0.1, "eval_reward_mean": 0.15}] + [
        {"step": s, "reward_mean": 0.2, **{k: 1.0 for k in keys}} for s in range(3)] + [
        {"step": 2, "eval_accuracy": 0.4, "eval_reward_mean": 0.3}]
    grouped = with_timing_groups(rows)
    timings = dict((t, k) for t, k, _ in panels_for(grouped))["stage timings"]
    assert len(timings) == 6 and all(k.startswith(GROUP_PREFIX) for k in timings)
    sums = {k.removeprefix(GROUP_PREFIX): v for k, v in grouped[1].items() if k.startswith(GROUP_PREFIX)}
    assert sums == {"step (total)": 1.0, "generation + scoring": 2.0, "training": 1.0, "weight sync": 1.0,
                    "sleep / wake": 5.0, "eval, checkpoint, other": 2.0}
    assert sum(sums.values()) == len(keys)  # every timing key lands in exactly one group
    write_metrics(tmp_path, rows)
    assert write_report(tmp_path).read_bytes()[:8] == PNG_MAGIC
