"""launch.serve's life cycle for real (launch/serve_life.py): a taken port is one line and exit 2
before Ray starts, and SIGTERM in the middle of start-up leaves no Ray process, socket or temp dir."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch.serve import main
from tasks.synthetic import write_dataset


@pytest.fixture()
def fake_export(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")  # passes the CLI's checks; a replica would fail to load it
    return model, write_dataset(tmp_path / "bird", num_databases=1, num_questions=6, seed=0)


def test_a_taken_port_is_one_line_and_exit_2(fake_export, capsys):
    model, bird = fake_export
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--model", str(model), "--bird-dir", str(bird), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"127.0.0.1:{port} is already in use" in err and "\n" not in err


def _ours(marker: str) -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in a for a in p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_sigterm_during_start_up_leaves_nothing_behind(fake_export, tmp_path):
    pytest.importorskip("psutil")
    model, bird = fake_export
    tmp = Path(tempfile.mkdtemp(prefix="arl-t", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--model", str(model), "--bird-dir", str(bird),
                             "--port", str(_free_port()), "--start-timeout", "300"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        ray_dir = None
        while time.monotonic() < deadline and proc.poll() is None:  # Ray is up: its session dir exists
            dirs = [d for d in tmp.glob("arl-serve-ray-*") if (d / "session_latest").exists()]
            if dirs and _ours(str(dirs[0])):
                ray_dir = dirs[0]
                break
            time.sleep(0.5)
        assert ray_dir is not None, proc.stderr.read() if proc.poll() is not None else "Ray did not start in 180 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftover = list(tmp.iterdir())
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert not [p for p in leftover if p.name.startswith("arl-serve-ray-")], leftover
    assert _ours(str(ray_dir)) == []  # no raylet, GCS, worker or agent of that cluster is left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
