"""The eval CLI: both prediction formats, BIRD's accuracy rules, per-question output, bad input."""
import json
import subprocess
import sys

import pytest

from launch.eval import main
from tasks.bird import load_split
from tasks.synthetic import write_dataset

SEP = "\t----- bird -----\t"


@pytest.fixture(scope="module")
def bird(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("evalbird") / "syn", num_databases=2, num_questions=40, seed=1)


def _predictions(questions):
    """Question i: gold (0, 1, 2 mod 6 and the reordered/duplicated variants), wrong, error, missing."""
    preds = {}
    for i, q in enumerate(questions):
        kind = i % 6
        if kind in (0, 1):
            preds[i] = q.sql
        elif kind == 2:  # same rows, different order and duplicates: still correct under BIRD's rule
            preds[i] = f"SELECT * FROM ({q.sql}) UNION ALL SELECT * FROM ({q.sql})"
        elif kind == 3:
            preds[i] = "SELECT 123456789"
        elif kind == 4:
            preds[i] = "SELECT no_such_column FROM nowhere"
        # kind 5: no prediction
    return preds


def test_official_format_accuracy_and_out_file(bird, tmp_path, capsys):
    qs = load_split(bird, "dev")
    preds = _predictions(qs)
    path = tmp_path / "predict_dev.json"
    path.write_text(json.dumps({str(i): f"{sql}{SEP}{qs[i].db_id}" for i, sql in preds.items()}))
    out = tmp_path / "results.jsonl"
    assert main(["--bird-dir", str(bird), "--split", "dev", "--predictions", str(path), "--out", str(out),
                 "--timeout", "5", "--workers", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(qs)
    expected = {0: "match", 1: "match", 2: "match", 3: "wrong_result", 4: "sql_error", 5: "no_sql"}
    for i, r in enumerate(rows):
        assert r["verdict"] == expected[i % 6], (i, r)
        assert r["reward"] == {"match": 1.0, "wrong_result": 0.1}.get(r["verdict"], 0.0)
    printed = capsys.readouterr().out
    acc = 100 * sum(r["correct"] for r in rows) / len(rows)
    assert f"{'total':<12} {len(qs):>6} {acc:>9.2f}" in printed
    assert "simple" in printed and "question(s) had no prediction" in printed


def test_jsonl_format_and_module_entry_point(bird, tmp_path):
    qs = load_split(bird, "dev")
    path = tmp_path / "preds.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": q.question_id, "sql": q.sql}) for q in qs) + "\n")
    proc = subprocess.run([sys.executable, "-m", "launch.eval", "--bird-dir", str(bird), "--predictions", str(path),
                           "--workers", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"{'total':<12} {len(qs):>6} {100.0:>9.2f}" in proc.stdout


@pytest.mark.parametrize("content, message", [
    (None, "predictions file not found"),
    ("{not json", "not valid JSON"),
    ('{"999": "SELECT 1\\t----- bird -----\\tretail"}', "question index 999 is outside the split"),
    ('{"0": "SELECT 1\\t----- bird -----\\twrong_db"}', "names db_id 'wrong_db'"),
    ('{"question_id": "nope", "sql": "SELECT 1"}\n', "question_id 'nope' is not in the split"),
    ('{"question_id": "0"}\n', "needs fields 'question_id' and 'sql'"),
])
def test_bad_predictions_exit_2_with_one_line(bird, tmp_path, capsys, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert main(["--bird-dir", str(bird), "--predictions", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_bad_bird_dir_exits_2(tmp_path, capsys):
    assert main(["--bird-dir", str(tmp_path / "missing"), "--predictions", str(tmp_path / "p.json")]) == 2
    assert "BIRD directory not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from tests.tiny_export import build

    return build(tmp_path_factory.mktemp("evalmodel"))


def _total_line(text: str) -> list[str]:
    """count, EX and Soft-F1 of the total line (R-VES, the last column, rests on measured times)."""
    return next(line for line in text.splitlines() if line.startswith("total")).split()[:4]


def test_model_accuracy_equals_scoring_its_own_predictions_file(export, tmp_path, capsys):
    model, bird = export
    out = tmp_path / "ev"
    assert main(["--bird-dir", str(bird), "--model", str(model), "--engine", "transformers", "--device", "cpu",
                 "--out-dir", str(out), "--workers", "1", "--timeout", "5"]) == 0
    generated = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    qs = load_split(bird, "dev")
    assert [r["question_id"] for r in rows] == [q.question_id for q in qs]
    assert 0 < sum(r["correct"] for r in rows) <= len(qs)  # the tiny export learnt some of its questions
    assert all(r["sql"] in r["completion"] for r in rows)  # the SQL extracted from the completion
    official = json.loads((out / "predict_dev.json").read_text())
    assert sorted(official, key=int) == [str(i) for i in range(len(qs))]
    assert main(["--bird-dir", str(bird), "--predictions", str(out / "predict_dev.json"), "--workers", "1",
                 "--timeout", "5"]) == 0
    rescored = capsys.readouterr().out
    assert _total_line(rescored) == _total_line(generated)
    assert "simple" in generated and "predictions:" in generated


def test_model_samples_majority_vote_and_pass_at_k(export, tmp_path, capsys):
    model, bird = export
    out = tmp_path / "ev"
    assert main(["--bird-dir", str(bird), "--model", str(model), "--engine", "transformers", "--device", "cpu",
                 "--samples", "3", "--temperature", "1.0", "--limit", "4", "--out-dir", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "pass@3 " in printed
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["sample_sqls"]) == 3 for r in rows)
    for r in rows:
        assert r["votes"] <= 3 and (not r["correct"] or r["pass_at_k"])  # a correct vote is a passing sample
        assert r["sql"] in [s for s in r["sample_sqls"] if s] + [""]


def test_model_with_max_turns_writes_every_turn_and_scores_the_final_answers(export, tmp_path, capsys):
    """--max-turns 2: each question is a multi-turn episode; results.jsonl holds its turns and the SQL
    scored is its final answer."""
    model, bird = export
    out = tmp_path / "ev"
    assert main(["--bird-dir", str(bird), "--model", str(model), "--engine", "transformers", "--device", "cpu",
                 "--max-turns", "2", "--limit", "4", "--out-dir", str(out), "--workers", "1", "--timeout", "5"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        (episode,) = r["episodes"]
        assert 1 <= episode["turns"] <= 2 and set(episode) >= {"queries", "tool_errors", "answer", "text"}
        assert r["sql"] == episode["answer"]
    assert main(["--bird-dir", str(bird), "--model", str(model), "--max-turns", "-1"]) == 2  # 0: as the export trained


def test_model_that_is_not_an_export_exits_2(tmp_path, bird, capsys):
    assert main(["--bird-dir", str(bird), "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_run_directory_as_model_names_its_newest_export(tmp_path, bird, capsys):
    for step in (2, 10):
        (tmp_path / "hf" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "hf" / f"step_{step}" / "config.json").write_text("{}")
    assert main(["--bird-dir", str(bird), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a run directory" in err and f"--model {tmp_path / 'hf' / 'step_10'}" in err and "\n" not in err


def test_default_out_dir_is_under_the_run_never_the_current_directory(tmp_path):
    from launch.eval import default_out_dir

    assert default_out_dir(str(tmp_path / "run" / "hf" / "step_8"), "dev") == tmp_path / "run" / "eval" / "step_8-dev"
    assert default_out_dir(str(tmp_path / "my_model"), "dev") == tmp_path / "eval-my_model-dev"
