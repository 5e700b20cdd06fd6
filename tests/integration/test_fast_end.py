"""A run's end: launch.local_ray.end_ray ends a local cluster's processes at once (the raylet first, the rest
together, bookkeeping ones killed outright) instead of ray.shutdown's one-by-one graceful stops, and leaves
no process of it behind; launch.cluster's exit skips Python's module teardown once main() returned."""
import subprocess
import sys

from launch.local_ray import KILLED_OUTRIGHT, _end_processes


def test_end_processes_terminates_the_raylet_first_and_kills_what_ignores_its_term():
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    procs = []
    for kind, code in (("gcs_server", stubborn), ("raylet", "import time; print('up', flush=True); time.sleep(60)"),
                       ("monitor", stubborn)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()  # its handler is set
        procs.append((kind, p))
    _end_processes(procs)
    assert all(p.poll() is not None for _, p in procs)  # every one ended, the stubborn GCS by SIGKILL at its bound
    codes = {kind: p.returncode for kind, p in procs}
    assert codes == {"raylet": -15, "gcs_server": -9, "monitor": -9}, codes  # the monitor killed outright
    assert "monitor" in KILLED_OUTRIGHT and "gcs_server" not in KILLED_OUTRIGHT and "raylet" not in KILLED_OUTRIGHT


def test_end_ray_leaves_no_process_of_the_local_cluster():
    code = """
import logging, psutil, ray
from launch.local_ray import end_ray, init_local_ray
init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
assert ray.get(ray.remote(lambda: 1).remote(), timeout=120) == 1
assert psutil.Process().children(recursive=True)
end_ray()
left = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
print("left", [c.name() for c in left], ray.is_initialized())
"""
    import os

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "left [] False" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_the_launcher_exits_with_main_s_code_and_its_output_flushed():
    p = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", "--print-config"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("}")
    bad = subprocess.run([sys.executable, "-m", "launch.cluster", "tiny", "learner.nope=1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "learner.nope" in bad.stderr
