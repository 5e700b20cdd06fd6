"""python -m launch.cluster <recipe> --dry-run as a subprocess: the plan's exit status and what it prints."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.cluster", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_cli_dry_run_bird_32b_exits_0_and_prints_numbers():
    r = _cli("bird_32b", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "GPUs: 32" in r.stdout and "ZeRO-3" in r.stdout and "15.26" in r.stdout and r.stdout.rstrip().endswith("FITS")


def test_cli_dry_run_that_cannot_fit_exits_1():
    r = _cli("bird_32b", "cluster.gpu_memory_gib=24", "--dry-run")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout


def test_cli_dry_run_gpu1_0p6b_async_fits_on_one_gpu():
    r = _cli("gpu1_0p6b", "coordinator.mode=async", "assembler.max_staleness=1", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "weight sync: cuda_ipc" in r.stdout and "generation+training" in r.stdout
    assert r.stdout.rstrip().endswith("FITS")

