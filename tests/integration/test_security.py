"""What we start listens on loopback or a unix socket only; a password never reaches the run dir.

SQL runs read-only: tests/integration/test_sandbox.py::test_hostile_query_is_contained proves that INSERT,
UPDATE, DELETE, DROP, ATTACH, triggers and stacked statements leave the database file's bytes
(sha256) and its directory unchanged.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from queues.redis_server import EmbeddedRedis
from tests.net import LOOPBACK, listening_on

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-pw-for-the-test"


def test_embedded_redis_has_no_tcp_port_by_default_and_loopback_when_asked(tmp_path):
    with EmbeddedRedis(tmp_path / "a") as r:
        c = redis.Redis(unix_socket_path=str(r.socket_path))
        assert c.config_get("port")["port"] == "0"
        assert oct(os.stat(r.socket_path.parent).st_mode & 0o777) == "0o700"
        c.close()
    with EmbeddedRedis(tmp_path / "b", tcp_port=0) as r:
        c = redis.Redis(unix_socket_path=str(r.socket_path))
        assert c.config_get("bind")["bind"] == "127.0.0.1"
        c.close()


def test_ray_on_loopback_makes_the_node_address_loopback_and_restores_it():
    from ray._private import ray_constants, services

    from launch.local_ray import RAY_LOCAL_ONLY, ray_on_loopback

    before = os.environ.get(RAY_LOCAL_ONLY), ray_constants.ENABLE_RAY_CLUSTER
    with ray_on_loopback(True):
        assert services.get_node_ip_address() in ("127.0.0.1", "::1")
        assert os.environ[RAY_LOCAL_ONLY] == "0"  # inherited by the GCS, raylet, agents and workers
    assert (os.environ.get(RAY_LOCAL_ONLY), ray_constants.ENABLE_RAY_CLUSTER) == before
    with ray_on_loopback(False):
        assert os.environ.get(RAY_LOCAL_ONLY) == before[0]


def test_run_with_password_listens_on_loopback_and_never_logs_the_password(tmp_path):
    from bench.faults.procs import descendants

    with EmbeddedRedis(tmp_path / "redis", tcp_port=0, password=SECRET) as server:
        url = f"redis://:{SECRET}@127.0.0.1:{server.tcp_port}/0"
        env = dict(os.environ, REDIS_URL=url)
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", "tiny", f"run_root={tmp_path}/runs",
                                 "coordinator.steps=2", "model.tiny_sft_steps=0", "coordinator.eval_every=0",
                                 f"cluster.redis_url={url}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        listening: dict[int, set[str]] = {}  # pid -> host:port it listened on
        titles: dict[int, set[str]] = {}  # pid -> every command line / Ray process title it showed
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in set(descendants(proc.pid)) | {proc.pid}:
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:300]
                except OSError:
                    continue
                titles.setdefault(pid, set()).add(title)
                listening.setdefault(pid, set()).update(listening_on({pid}))
            time.sleep(0.5)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
        assert proc.returncode == 0, out
        assert SECRET not in out
        for path in (tmp_path / "runs").rglob("*"):
            if path.is_file() and path.stat().st_size < 50_000_000:
                assert SECRET.encode() not in path.read_bytes(), f"password in {path}"

    def named(pid: int) -> str:
        return " | ".join(sorted(titles[pid]))

    # Seen listening: the GCS, the raylet (node + object manager), the learner; the dashboard too, unless the
    # 2-step run ended before it bound its port (seen once in CI on a loaded 2-core machine: running, not yet
    # listening). Whatever was seen listening is checked below.
    for name in ("ray/gcs/gcs_server", "raylet/raylet", "LearnerShell", "dashboard/dashboard.py"):
        seen = sum(1 for p, a in listening.items() if a and name in named(p))
        assert seen == 1 or (seen == 0 and name.startswith("dashboard")), (name, [named(p)[:200] for p in listening])
    exposed = {p: sorted(a for a in addrs if not a.startswith(LOOPBACK)) for p, addrs in listening.items()}
    exposed = {p: addrs for p, addrs in exposed.items() if addrs}
    # Ray (GCS, raylet, every worker's core worker, agents, metrics, dashboard), Redis and the
    # learner's world-of-one process group (an in-process store, no TCPStore): loopback only.
    assert exposed == {}, {named(p)[:200]: a for p, a in exposed.items()}
