"""What the benches' command lines share: a work directory (given, or a fresh temp dir) and the JSON and
markdown reports they leave behind (--json, --md).

Invariant: `work_dir` returns an absolute directory that exists; `write_reports` writes only the files
asked for, the markdown ending in one newline.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--md", default="", help="also write the markdown tables here")


def work_dir(given: str, prefix: str) -> Path:
    """`given` (created if missing), or a new temp dir named `prefix*`; absolute."""
    path = Path(given or tempfile.mkdtemp(prefix=prefix)).absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_reports(a: argparse.Namespace, payload, md: str) -> None:
    """`payload` as JSON to --json and `md` to --md, each when given."""
    if getattr(a, "json", ""):
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str))
    if getattr(a, "md", ""):
        Path(a.md).write_text(md.rstrip("\n") + "\n")
