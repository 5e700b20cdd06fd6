"""Execution accuracy of predictions on a BIRD split, with BIRD's official rules.

    python -m launch.eval --bird-dir DIR --split dev --predictions FILE [--out results.jsonl]
                          [--timeout S] [--workers N]

FILE is BIRD's prediction format (a JSON object {"<question index>": "SQL\\t----- bird -----\\tdb_id"})
or JSONL of {"question_id", "sql"}. A question is correct when set(pred_rows) == set(gold_rows);
a prediction that fails, times out, or is missing counts as incorrect, exactly as BIRD counts it.

Invariants: bad input is one line on stderr and exit code 2; every question of the split gets
one verdict; predictions run in the same sandbox as training rewards.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from policies.sql_reward import GOLD_FAILED, NO_SQL, reward_for, verdict_for
from tasks.bird import BirdDataError, load_split
from tasks.sandbox import SqlPool

_BIRD_SEP = "\t----- bird -----\t"
DIFFICULTIES = ("simple", "moderate", "challenging")


class EvalInputError(ValueError):
    pass


def read_predictions(path: Path, questions) -> dict[str, str]:
    """{question_id: sql} from either accepted format; refuses unknown ids and wrong databases."""
    if not path.is_file():
        raise EvalInputError(f"predictions file not found: {path}")
    text = path.read_text(encoding="utf-8-sig")
    by_id = {q.question_id: q for q in questions}
    preds: dict[str, str] = {}
    stripped = text.lstrip()
    if stripped.startswith("{") and not _looks_like_jsonl(stripped):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise EvalInputError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
        for key, value in raw.items():
            if not isinstance(value, str):
                raise EvalInputError(f"{path}: prediction {key!r} is not a string")
            try:
                index = int(key)
            except ValueError:
                raise EvalInputError(f"{path}: key {key!r} is not a question index") from None
            if not 0 <= index < len(questions):
                raise EvalInputError(f"{path}: question index {index} is outside the split (0..{len(questions) - 1})")
            sql, sep, db_id = value.partition(_BIRD_SEP)
            q = questions[index]
            if sep and db_id.strip() and db_id.strip() != q.db_id:
                raise EvalInputError(f"{path}: prediction {key} names db_id {db_id.strip()!r}, question {index} is on {q.db_id!r}")
            preds[q.question_id] = sql
        return preds
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise EvalInputError(f"{path}:{lineno}: not a JSON object") from None
        if not isinstance(row, dict) or "question_id" not in row or not isinstance(row.get("sql"), str):
            raise EvalInputError(f"{path}:{lineno}: needs fields 'question_id' and 'sql' (a string)")
        qid = str(row["question_id"])
        if qid not in by_id:
            raise EvalInputError(f"{path}:{lineno}: question_id {qid!r} is not in the split")
        preds[qid] = row["sql"]
    return preds


def _looks_like_jsonl(text: str) -> bool:
    first = text.split("\n", 1)[0].strip()
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "question_id" in row


def evaluate(questions, preds: dict[str, str], pool: SqlPool) -> list[dict]:
    """One result row per question: verdict and reward (1/0 accuracy is verdict == match)."""
    jobs, slots = [], []
    golds = {}
    for q in questions:
        key = (q.db_path, q.sql)
        if key not in golds:
            golds[key] = len(jobs)
            jobs.append(key)
        sql = (preds.get(q.question_id) or "").strip()
        if sql:
            slots.append(len(jobs))
            jobs.append((q.db_path, sql))
        else:
            slots.append(None)
    results = pool.run_many(jobs)
    rows = []
    for q, slot in zip(questions, slots):
        gold = results[golds[(q.db_path, q.sql)]]
        if slot is None:
            verdict, error = verdict_for("no_sql", [], gold.status, gold.rows), ""
        else:
            pred = results[slot]
            verdict, error = verdict_for(pred.status, pred.rows, gold.status, gold.rows), pred.error
        if verdict == GOLD_FAILED:
            error = gold.error
        rows.append({"question_id": q.question_id, "db_id": q.db_id, "difficulty": q.difficulty,
                     "verdict": verdict, "reward": reward_for(verdict), "correct": verdict == "match",
                     "error": error})
    return rows


def summary_table(rows: list[dict]) -> str:
    groups: dict[str, list[dict]] = collections.OrderedDict((d, []) for d in DIFFICULTIES)
    for r in rows:
        groups.setdefault(r["difficulty"] or "unknown", []).append(r)
    lines = [f"{'difficulty':<12} {'count':>6} {'EX %':>7}"]
    for name, rs in groups.items():
        if rs:
            lines.append(f"{name:<12} {len(rs):>6} {100 * sum(r['correct'] for r in rs) / len(rs):>7.2f}")
    total = len(rows)
    acc = 100 * sum(r["correct"] for r in rows) / total if total else 0.0
    lines.append(f"{'total':<12} {total:>6} {acc:>7.2f}")
    verdicts = collections.Counter(r["verdict"] for r in rows)
    lines.append("verdicts: " + ", ".join(f"{v}={c}" for v, c in sorted(verdicts.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--bird-dir", required=True)
    p.add_argument("--split", default="dev")
    p.add_argument("--predictions", required=True)
    p.add_argument("--out", default="")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per query (BIRD's default is 30)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-rows", type=int, default=1_000_000)
    args = p.parse_args(argv)
    if args.timeout <= 0 or args.workers < 1:
        print("error: --timeout must be > 0 and --workers >= 1", file=sys.stderr)
        return 2
    try:
        questions = load_split(args.bird_dir, args.split)
        preds = read_predictions(Path(args.predictions), questions)
    except (BirdDataError, EvalInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with SqlPool(workers=args.workers, timeout_s=args.timeout, max_rows=args.max_rows) as pool:
        rows = evaluate(questions, preds, pool)
    missing = sum(1 for q in questions if not (preds.get(q.question_id) or "").strip())
    print(summary_table(rows))
    if missing:
        print(f"{missing} question(s) had no prediction (counted as {NO_SQL}, incorrect)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
