"""python -m launch.report as a subprocess: it writes the PNG and prints its path."""
import subprocess
import sys
from pathlib import Path

from tests.builders import synthetic_rows, write_metrics

REPO = Path(__file__).resolve().parents[2]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cli_module_runs(tmp_path):
    write_metrics(tmp_path, synthetic_rows(5))
    r = subprocess.run([sys.executable, "-m", "launch.report", str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes()[:8] == PNG_MAGIC

