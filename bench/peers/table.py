"""The peer bench's table and its list of differences: pure functions of the measured rows.

Invariants: one markdown row per side, every column from that side's own measurement (a missing
number prints as "-", never as 0); the ratio line compares each of our rows with the peer row on
the same columns; the differences are listed under the table, as given, one bullet each. Over several
seeds (`over_seeds`): a side's row is the mean of its seeds' rows and their range on each column, and the
ratios are the ratios of those means.
"""
from __future__ import annotations

COLUMNS = [
    ("samples_per_s_e2e", "samples/s end to end", "{:.1f}"),
    ("samples_per_s_step", "samples/s per step (median)", "{:.1f}"),
    ("first_step_s", "s to first step", "{:.1f}"),
    ("after_last_step_s", "s after the last step", "{:.1f}"),
    ("s_per_step_median", "s/step (median)", "{:.2f}"),
    ("wall_s", "whole command, s", "{:.0f}"),
    ("ex_greedy", "held-out greedy EX (BIRD rule)", "{:.3f}"),
    ("ex_greedy_strict", "greedy EX, strict", "{:.3f}"),
    ("sampled_reward", "held-out sampled reward", "{:.3f}"),
    ("peak_rss_gb", "peak RSS, process tree (GB)", "{:.2f}"),
    ("peak_pss_gb", "peak PSS, process tree (GB)", "{:.2f}"),
]


def cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    text = fmt.format(v)
    if key == "peak_rss_gb" and row.get("peak_processes"):
        text += f" ({row['peak_processes']} proc.)"
    return text


def markdown(rows: list[dict], columns: list[tuple[str, str, str]] | None = None) -> str:
    columns = COLUMNS if columns is None else columns
    head = "| | " + " | ".join(c[1] for c in columns) + " |"
    sep = "| --- | " + " | ".join("---:" for _ in columns) + " |"
    body = ["| " + r["name"] + " | " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def ratios(ours: dict, peer: dict) -> str:
    """`name`: samples/s end to end x, per step x, memory x (ours over the peer's)."""
    def r(key: str) -> str:
        a, b = ours.get(key), peer.get(key)
        return f"{a / b:.2f}x" if a is not None and b else "-"
    return (f"{ours['name']} against {peer['name']}: samples/s end to end {r('samples_per_s_e2e')}, "
            f"per step {r('samples_per_s_step')}, peak memory {r('peak_rss_gb')} (RSS), {r('peak_pss_gb')} (PSS)")


def report(rows: list[dict], peer: dict | None, differences: list[str]) -> str:
    lines = [markdown(rows + ([peer] if peer else []))]
    if peer:
        lines += [""] + [ratios(r, peer) for r in rows]
    if differences:
        lines += ["", "Setup differences that remain:"] + [f"- {d}" for d in differences]
    return "\n".join(lines)


SEED_COLUMNS = ("samples_per_s_e2e", "samples_per_s_step", "first_step_s", "after_last_step_s", "ex_greedy",
                "sampled_reward", "peak_rss_gb", "peak_pss_gb")


def _strip_seed(name: str) -> str:
    return name.split(" (seed ")[0]


def mean_row(rows: list[dict]) -> dict:
    """The mean of `rows` (one side's, one per seed) on SEED_COLUMNS, with `<key>_range` (min, max)."""
    out: dict = {"name": _strip_seed(rows[0]["name"]) + f" ({len(rows)} seeds)"}
    for key in SEED_COLUMNS:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            out[key], out[key + "_range"] = sum(vals) / len(vals), (min(vals), max(vals))
    return out


def over_seeds(runs: list[dict]) -> str:
    """`runs`: one {"seed", "rows", "peer"} per seed. A table of each side's means (ranges beside), then the
    ratio of our means over the peer's."""
    fmt = {k: f for k, _, f in COLUMNS}
    head = "| | " + " | ".join(t for k, t, _ in COLUMNS if k in SEED_COLUMNS) + " |"
    sep = "| --- | " + " | ".join("---:" for k, _, _ in COLUMNS if k in SEED_COLUMNS) + " |"
    sides = [[r["rows"][i] for r in runs] for i in range(len(runs[0]["rows"]))]
    if all(r.get("peer") for r in runs):
        sides.append([r["peer"] for r in runs])
    means = [mean_row(rows) for rows in sides]

    def c(row: dict, key: str) -> str:
        if row.get(key) is None:
            return "-"
        lo, hi = row[key + "_range"]
        return f"{fmt[key].format(row[key])} ({fmt[key].format(lo)}-{fmt[key].format(hi)})"
    body = ["| " + m["name"] + " | " + " | ".join(c(m, k) for k, _, _ in COLUMNS if k in SEED_COLUMNS) + " |"
            for m in means]
    lines = [head, sep, *body]
    if len(sides) > len(runs[0]["rows"]):
        lines += [""] + [ratios(m, means[-1]) for m in means[:-1]]
    return "\n".join(lines)
