"""docs/PERFORMANCE.md's table is what `python -m bench.table` makes from docs/perf/*.md (never typed by hand),
and a page without its summary lines is one error naming the page and the line."""
from pathlib import Path

import pytest

from bench import table


def test_the_index_table_is_generated_from_the_pages():
    pages = sorted(table.PERF_DIR.glob("*.md"))
    assert pages, "docs/perf/ has no pages"
    text = table.INDEX.read_text()
    assert table.render(text, pages) == text, "docs/PERFORMANCE.md is stale: run python -m bench.table"
    for p in pages:  # every page is a row, linked
        assert f"](perf/{p.name})" in text


def test_a_page_without_its_date_line_is_one_error_naming_it(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(table, "ROOT", tmp_path)
    page = tmp_path / "x.md"
    page.write_text("# X\n\n- **Summary:** s\n- **Command:** `c`\n- **Machine:** m\n")
    with pytest.raises(table.PageError, match=r"x\.md: no Date line"):
        table.read_page(page)


def test_render_replaces_only_the_text_between_the_markers(tmp_path: Path):
    page = tmp_path / "a.md"
    page.write_text("# A | b\n\n- **Summary:** s\n- **Command:** `c`\n- **Machine:** m\n- **Date:** d\n")
    index = f"head\n{table.BEGIN}\nold rows\n{table.END}\ntail\n"
    out = table.render(index, [page])
    assert out.startswith(f"head\n{table.BEGIN}\n") and out.endswith(f"\n{table.END}\ntail\n")
    assert "old rows" not in out and "| [A \\| b](perf/a.md) | s | `c` | m | d |" in out
