"""docs/PERFORMANCE.md's summary table, generated from the docs/perf/*.md pages it indexes.

    python -m bench.table            # rewrite the table between the markers in docs/PERFORMANCE.md
    python -m bench.table --check    # exit 1 (and say which page) when the table is not what the pages say

Every docs/perf/<topic>.md opens with its title (`# ...`) and a summary block of four lines:

    - **Summary:** the headline figure, in one sentence
    - **Command:** `the command that produced it`
    - **Machine:** where it ran
    - **Date:** when

Invariants: the table has one row per page, in file-name order, each cell copied from that page's block
(nothing typed into PERFORMANCE.md by hand between the markers); a page without its title or any of the
four lines is an error naming the page and the missing line; only the text between the markers changes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF_DIR = ROOT / "docs" / "perf"
INDEX = ROOT / "docs" / "PERFORMANCE.md"
BEGIN, END = "<!-- perf-table:begin (python -m bench.table) -->", "<!-- perf-table:end -->"
KEYS = ("Summary", "Command", "Machine", "Date")
_LINE = re.compile(r"^- \*\*(" + "|".join(KEYS) + r"):\*\* (.+)$")


class PageError(ValueError):
    """A docs/perf page without its title or one of its summary lines."""


def read_page(path: Path) -> dict[str, str]:
    """The page's title and its four summary lines (the first of each)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "title" not in out and line.startswith("# "):
            out["title"] = line[2:].strip()
        m = _LINE.match(line.strip())
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2).strip()
    missing = [k for k in ("title", *KEYS) if k not in out]
    if missing:
        raise PageError(f"{path.relative_to(ROOT)}: no {', '.join(missing)} line (see bench/table.py)")
    return out


def table(pages: list[Path]) -> str:
    rows = ["| topic | headline | command | machine | date |", "| --- | --- | --- | --- | --- |"]
    for p in pages:
        d = read_page(p)
        cells = [f"[{d['title']}](perf/{p.name})", d["Summary"], d["Command"], d["Machine"], d["Date"]]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def render(index_text: str, pages: list[Path]) -> str:
    """index_text with the text between the markers replaced by the table."""
    if index_text.count(BEGIN) != 1 or index_text.count(END) != 1:
        raise PageError(f"{INDEX.relative_to(ROOT)}: needs one {BEGIN!r} and one {END!r} line")
    head, rest = index_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(pages)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when the table is stale")
    args = p.parse_args(argv)
    pages = sorted(PERF_DIR.glob("*.md"))
    try:
        text = INDEX.read_text()
        new = render(text, pages)
    except PageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"error: {INDEX.relative_to(ROOT)}'s table is stale: run python -m bench.table", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(new)
    print(f"{INDEX.relative_to(ROOT)}: {len(pages)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
