"""launch.serve's life cycle for real (launch/serve_life.py): a taken port is one line and exit 2
before Ray starts; SIGTERM in the middle of start-up, or while serving, leaves no Ray process, socket
or temp dir; served beyond loopback with a key, the HTTP proxy is the one socket not on loopback."""
import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from launch.serve import main
from tasks.synthetic import write_dataset
from tests.net import LOOPBACK, free_port, listening_on

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-the-life-test"


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
    with _serving([sys.executable, "-m", "launch.serve", "--model", str(model), "--bird-dir", str(bird),
                   "--port", str(free_port()), "--start-timeout", "300"], {}) as run:
        proc, tmp = run["proc"], run["tmp"]
        deadline = time.monotonic() + 180
        ray_dir = None
        while time.monotonic() < deadline and proc.poll() is None:  # Ray is up: its session dir exists
            dirs = [d for d in tmp.glob("arl-serve-ray-*") if (d / "session_latest").exists()]
            if dirs and _ours(str(dirs[0])):
                ray_dir = dirs[0]
                break
            time.sleep(0.5)
        assert ray_dir is not None, proc.stderr.read() if proc.poll() is not None else "Ray did not start in 180 s"
        err = _sigterm(proc)
    _assert_stopped_clean(proc, err, run["leftover"])
    assert _ours(str(ray_dir)) == []  # no raylet, GCS, worker or agent of that cluster is left


@contextlib.contextmanager
def _serving(argv: list[str], env: dict):
    """The CLI in its own short TMPDIR (Ray's socket paths must fit 107 bytes); at exit it is killed if
    still running, and run["leftover"] lists the arl-serve-ray-* dirs it left."""
    tmp = Path(tempfile.mkdtemp(prefix="arl-t", dir="/tmp"))
    full_env = dict(os.environ, TMPDIR=str(tmp), **env)
    full_env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = {"proc": proc, "tmp": tmp, "leftover": []}
    try:
        yield run
    finally:
        if proc.poll() is None:
            proc.kill()
        run["leftover"] = [p for p in tmp.iterdir() if p.name.startswith(("arl-serve-ray-", "arl-sqlpool-"))]
        shutil.rmtree(tmp, ignore_errors=True)


def _sigterm(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)[1]


def _assert_stopped_clean(proc, err: str, leftover: list) -> None:
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert leftover == []  # Ray's temp dir and the sandbox pool's


@pytest.mark.slow
def test_beyond_loopback_only_the_proxy_is_exposed_it_needs_the_key_and_sigterm_leaves_nothing(tmp_path):
    """`--host 0.0.0.0` with ARL_API_KEY on the tiny export, as a user starts it: the printed commands
    carry $ARL_API_KEY (never the key); every listening socket of the service's process tree is on
    loopback except the proxy's; through that socket a request without the key is a 401 and one with
    it is answered; SIGTERM while serving ends it with exit 0 and nothing of it left."""
    psutil = pytest.importorskip("psutil")
    import httpx

    from bench.faults.procs import descendants
    from tests.tiny_export import build

    model, bird = build(tmp_path / "export")
    port = free_port()
    with _serving([sys.executable, "-m", "launch.serve", "--model", str(model), "--bird-dir", str(bird),
                   "--host", "0.0.0.0", "--port", str(port), "--start-timeout", "300"], {"ARL_API_KEY": KEY}) as run:
        proc = run["proc"]
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
        printed: list[str] = []
        deadline = time.monotonic() + 300
        while not any(ln.startswith("ready:") for ln in printed):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "not ready"
            try:
                printed.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        time.sleep(1)  # the rest of the ready message
        while not lines.empty():
            printed.append(lines.get())
        tree = set(descendants(proc.pid)) | {proc.pid}
        listening = listening_on(tree)
        exposed = sorted(a for a in listening if not a.startswith(LOOPBACK))
        assert exposed == [f"00000000:{port}"], (exposed, listening)  # 0.0.0.0:<port>, the proxy alone
        addrs = [a.address for nic in psutil.net_if_addrs().values() for a in nic
                 if a.family == socket.AF_INET and not a.address.startswith("127.")]
        base = f"http://{addrs[0] if addrs else '127.0.0.1'}:{port}"
        health = httpx.get(base + "/healthz", timeout=60)  # answered in the proxy (launch/serve_health.py)
        assert health.status_code == 200 and health.headers["x-arl-healthz"] == "proxy", health.headers
        assert httpx.get(base + "/healthz/x", timeout=60).status_code == 401
        assert httpx.get(base + "/-/routes", timeout=60).status_code == 401  # the app names are behind the key
        routes = httpx.get(base + "/-/routes", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert routes.json() == {"/": "arl-sql"}  # no health app
        r = httpx.get(base + "/v1/databases", timeout=60)
        assert r.status_code == 401 and r.json() == {"error": "missing API key: send the header 'Authorization: Bearer <key>'"}
        r = httpx.get(base + "/v1/databases", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.json()["databases"]
        err = _sigterm(proc)
    out = "".join(printed)
    assert 'curl -s -H "Authorization: Bearer $ARL_API_KEY"' in out and "API key required" in out
    assert KEY not in out + err
    _assert_stopped_clean(proc, err, run["leftover"])
    alive = [pid for pid in tree - {proc.pid} if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert alive == []


def test_lower_priority_lowers_every_thread_and_what_they_start_later():
    """In a process of its own (never this one): a thread started before the call, the calling thread,
    and a child process started after it by the older thread all run `steps` nice levels lower."""
    import json

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("per-thread nice values are Linux's")
    code = (
        "import json, os, subprocess, sys, threading\n"
        "from launch.serve_life import lower_priority\n"
        "base = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "go, out = threading.Event(), []\n"
        "def older():\n"
        "    go.wait()\n"
        "    out.append(int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'],\n"
        "                                  capture_output=True, text=True).stdout))\n"
        "t = threading.Thread(target=older)\n"
        "t.start()\n"
        "nice = lower_priority(3)\n"
        "threads = sorted({os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir('/proc/self/task')})\n"
        "go.set()\n"
        "t.join()\n"
        "print(json.dumps({'base': base, 'nice': nice, 'threads': threads, 'child': out[0]}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = min(19, got["base"] + 3)
    assert got["nice"] == want and got["threads"] == [want] and got["child"] == want, got
