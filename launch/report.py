"""python -m launch.report RUN_DIR [RUN_DIR ...] [--out FILE.png]: one PNG of a run's metrics.jsonl,
or, given several runs (e.g. seeds of one recipe), one PNG comparing them.

Panels (each drawn only when at least one of its keys has a value; a step missing a key is a gap):
    reward          eval_reward_mean (held-out, sampled: the README's headline), reward_mean (training,
                    raw and smoothed: mean of the last SMOOTH steps)
    accuracy        eval_accuracy (held-out, greedy), accuracy (training samples)
    response length response_len_mean
    stage timings   every key starting with "time_" (seconds per step, one line each); more than
                    MAX_TIMING_SERIES of them are summed into TIMING_GROUPS (at most six lines)
Several runs: three panels side by side, held-out reward (sampled), held-out accuracy (greedy) and
training reward (mean of the last SMOOTH steps), one colour per run, labelled by the run's seed and
generator.max_turns where the runs' configs differ in them (else by directory name); written to --out
(default compare.png in the current directory).
The held-out lines are the bold ones, the training lines thin; the title carries the held-out numbers
before -> after (launch.progress.summary, the line the run ends with).
Rows are {"step": int, "time": float, ...scalars}; null values (NaN when logged) are skipped. Rows of
step < 0 are the evaluation before training and are drawn at step 0. Every series has its own colour
across the whole figure; legends sit outside the plots. The title counts training steps (distinct
steps >= 0), not rows.

Invariant: the report either writes a valid PNG and prints its path (exit 0), or prints one line
naming the problem (missing/empty/unreadable metrics file, nothing to plot) and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from config import layout

PANELS: list[tuple[str, list[str], str]] = [
    ("reward", ["eval_reward_mean", "reward_mean"], "reward"),
    ("accuracy", ["eval_accuracy", "accuracy"], "fraction"),
    ("response length", ["response_len_mean"], "tokens"),
]
TIMING_PREFIX = "time_"
SMOOTH = 10  # training reward: mean over the last SMOOTH logged steps
MAX_TIMING_SERIES = 6
GROUP_PREFIX = "time_group:"
# (group, substrings of the keys it sums); the first match wins, the last group takes the rest.
TIMING_GROUPS = [("step (total)", ("time_step",)), ("sleep / wake", ("sleep", "wake", "pause")),
                 ("generation + scoring", ("generat", "scor")), ("training", ("train",)), ("weight sync", ("sync",)),
                 ("eval, checkpoint, other", ("",))]
LABELS = {"eval_reward_mean": "held-out reward (sampled)", "reward_mean": "training reward",
          "eval_accuracy": "held-out accuracy (greedy)", "accuracy": "training accuracy"}


class ReportError(ValueError):
    """A one-line, user-facing report error."""


def load_rows(metrics_file: Path) -> list[dict]:
    if not metrics_file.is_file():
        raise ReportError(f"no metrics file at {metrics_file}")
    rows = []
    for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ReportError(f"{metrics_file}:{number}: not JSON ({e})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ReportError(f"{metrics_file}:{number}: a row needs a JSON object with a \"step\" key")
        rows.append(row)
    if not rows:
        raise ReportError(f"metrics file {metrics_file} is empty")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` where it is a finite number (the pre-training eval at step 0)."""
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(float(max(0, row["step"])))
            values.append(float(v))
    return steps, values


def smoothed(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean over up to `window` values (the first ones average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def training_steps(rows: list[dict]) -> int:
    return len({row["step"] for row in rows if isinstance(row.get("step"), int) and row["step"] >= 0})


def timing_group(key: str) -> str:
    return next(name for name, parts in TIMING_GROUPS if any(p in key for p in parts))


def with_timing_groups(rows: list[dict]) -> list[dict]:
    """Rows with GROUP_PREFIX + group = the sum of the row's finite time_* values in that group."""
    out = []
    for row in rows:
        extra: dict[str, float] = {}
        for k, v in row.items():
            if k.startswith(TIMING_PREFIX) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                g = GROUP_PREFIX + timing_group(k)
                extra[g] = extra.get(g, 0.0) + float(v)
        out.append({**row, **extra})
    return out


def panels_for(rows: list[dict]) -> list[tuple[str, list[str], str]]:
    """The panels that have data, each with only its keys that have data; over MAX_TIMING_SERIES
    timing keys, the timing groups instead (rows from with_timing_groups)."""
    timing_keys = sorted({k for row in rows for k in row if k.startswith(TIMING_PREFIX)})
    if len(timing_keys) > MAX_TIMING_SERIES:
        timing_keys = [GROUP_PREFIX + name for name, _ in TIMING_GROUPS]
    out = []
    for title, keys, unit in PANELS + [("stage timings", timing_keys, "seconds")]:
        present = [k for k in keys if series(rows, k)[0]]
        if present:
            out.append((title, present, unit))
    return out


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = with_timing_groups(load_rows(layout.metrics_file(run_dir)))
    panels = panels_for(rows)
    if not panels:
        raise ReportError(f"{run_dir / 'metrics.jsonl'} has none of reward_mean, eval_accuracy, accuracy, "
                          f"response_len_mean or {TIMING_PREFIX}* keys")
    out_path = Path(out) if out else run_dir / "report.png"
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), sharex=True, squeeze=False)
    colours = iter(plt.get_cmap("tab20").colors)
    for ax, (title, keys, unit) in zip(axes[:, 0], panels):
        for key in keys:
            steps, values = series(rows, key)
            marker = "o" if len(steps) < 30 else None
            label = LABELS.get(key, key.removeprefix(GROUP_PREFIX))
            held_out = key.startswith("eval_")
            if key == "reward_mean" and len(values) > SMOOTH:
                ax.plot(steps, values, color=next(colours), alpha=0.3, linewidth=0.6, label=f"{label} (raw)")
                ax.plot(steps, smoothed(values), color=next(colours), linewidth=1.0, alpha=0.8,
                        label=f"{label} (mean of last {SMOOTH})")
                continue
            ax.plot(steps, values, color=next(colours), marker=marker, markersize=4 if held_out else 2,
                    linewidth=2.8 if held_out else 1.0, alpha=1.0 if held_out else 0.7, zorder=3 if held_out else 2,
                    label=label)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes[-1, 0].set_xlabel("step")
    from launch.progress import summary

    before_after = summary(run_dir)
    fig.suptitle(f"{run_dir.name}: {training_steps(rows)} training steps" + (f"\n{before_after}" if before_after else ""))
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    plt.close(fig)
    return out_path


LABEL_KEYS = (("seed", "seed"), ("generator.max_turns", "max_turns"))  # config key, label word


def _config_value(run_dir: Path, dotted: str):
    try:
        value = json.loads(layout.config_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _label(run_dir: Path, dirs: list[Path]) -> str:
    """The run's values of the LABEL_KEYS that differ among `dirs` ("seed 1, max_turns 3"), else its name."""
    words = [f"{word} {_config_value(run_dir, key)}" for key, word in LABEL_KEYS
             if len({_config_value(d, key) for d in dirs}) > 1]
    return ", ".join(words) or run_dir.name


def write_comparison(run_dirs: list, out: str | Path | None = None) -> Path:
    """One figure of several runs: held-out reward, held-out greedy accuracy, training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(d) for d in run_dirs]
    runs = [(d, load_rows(layout.metrics_file(d))) for d in dirs]
    keys = [("eval_reward_mean", "held-out reward (sampled)"), ("eval_accuracy", "held-out accuracy (greedy)"),
            ("reward_mean", f"training reward (mean of last {SMOOTH})")]
    if not any(series(rows, k)[0] for _, rows in runs for k, _ in keys):
        raise ReportError("none of the runs has eval_reward_mean, eval_accuracy or reward_mean")
    out_path = Path(out) if out else Path("compare.png")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), sharey=True, squeeze=False)
    colours = plt.get_cmap("tab10").colors
    for ax, (key, title) in zip(axes[0], keys):
        for i, (d, rows) in enumerate(runs):
            steps, values = series(rows, key)
            if key == "reward_mean":
                values = smoothed(values)
            ax.plot(steps, values, color=colours[i % len(colours)], marker="o" if len(steps) < 30 else None,
                    markersize=3, label=_label(d, dirs))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylim(0, 1)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.report", description="Plot a run's metrics.jsonl to a PNG.")
    p.add_argument("run_dir", nargs="+", help="the run directory holding metrics.jsonl (several: compare them)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/report.png; compare.png for several runs)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if len(args.run_dir) > 1:
            path = write_comparison(args.run_dir, args.out)
        else:
            path = write_report(args.run_dir[0], args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
