"""Every `python -m launch.cluster ...` line of the README and the guides (docs/DESIGN.md, docs/guide/*.md) names a
recipe and overrides the CLI accepts as typed (the same parse_args and apply_overrides, so a renamed or retyped
key fails here, not on a user's machine), and each documented `--dry-run` plan fits."""
import shlex
from pathlib import Path

import pytest

from config import apply_overrides
from config.recipes import get_recipe
from launch.cluster import parse_args

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "DESIGN.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv after `launch.cluster`) of each indented command line, continuation lines joined."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            start, line = i + 1, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            if not line.startswith("    ") or "-m launch.cluster" not in line:
                continue
            words = shlex.split(line.split("&&")[-1], comments=True)
            found.append((f"{page.relative_to(ROOT)}:{start}", words[words.index("launch.cluster") + 1:]))
    return found


COMMANDS = documented_commands()


def test_the_pages_document_commands():
    assert len(COMMANDS) >= 20 and any(argv == ["tiny"] for _, argv in COMMANDS)


@pytest.mark.parametrize("where, argv", [c for c in COMMANDS if "--help" not in c[1]], ids=[c[0] for c in COMMANDS if "--help" not in c[1]])
def test_documented_command_parses_and_its_overrides_validate(where, argv):
    args = parse_args(argv)
    cfg = apply_overrides(get_recipe(args.recipe), args.overrides)  # ConfigError: one line naming the key
    if args.dry_run:
        from launch.plan import make_plan

        assert make_plan(cfg).fits, f"{where}: the documented --dry-run plan does not fit"
