"""launch.serve's /healthz (launch/serve_health.py): answered in Ray Serve's proxy itself (or by an app of
its own), so it does not wait behind the model replica, and true about it.

For real: a local Ray started with launch.serve's proxy settings (as the CLI starts one), Ray Serve's
proxy, the tiny export. The model replica is frozen with SIGSTOP (it can neither run nor answer): a
request to it stays pending while /healthz answers 200 from the proxy; kept frozen past the controller's
health-check timeout, /healthz turns 503 (one line) while the controller replaces the replica, and 200
again once the new one runs. Events and bounded waits only, no timed assertion. The verdict itself
(fresh, stale, not deployed, no RUNNING replica) is a pure function, and the proxy's middleware an ASGI
app, both tested without Ray (the controller a stand-in).
"""
import concurrent.futures
import os
import signal
import time

import pytest

from launch.serve_health import ANSWERED_BY, summarize, verdict
from tests.clusters import ray_cluster
from tests.tiny_export import build

httpx = pytest.importorskip("httpx")

KEY = "k3y-for-the-health-tests"


def _poll(client, want: int, deadline_s: float) -> httpx.Response:
    """GET /healthz until it answers `want` (bounded)."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = client.get("/healthz")
        if r.status_code == want or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


@pytest.mark.slow  # its own Ray and Serve app, and a replica replaced by the controller
def test_healthz_answers_while_the_model_replica_is_frozen_and_turns_503_when_the_controller_drops_it(tmp_path,
                                                                                                     monkeypatch):
    from ray import serve

    from launch.serve_app import ServeOptions, start
    from launch.serve_health import MODEL_APP, MODEL_DEPLOYMENT, proxy_env
    from launch.serve_http import key_digest
    from tests.net import free_port

    model, bird = build(tmp_path / "export")
    opts = ServeOptions(model=str(model), bird_dir=str(bird), engine="transformers", device="cpu",
                        sql_workers=1, api_key_sha256=key_digest(KEY), health_poll_s=0.5)
    for k, v in proxy_env(MODEL_APP, MODEL_DEPLOYMENT, opts, 2).items():  # before Ray starts, as the CLI does
        monkeypatch.setenv(k, v)
    with ray_cluster("ray-serve-health-"):
        try:
            # the controller gives up on a replica that does not answer its health check for 15 s (Ray's
            # default 30 s; short enough for a test, long enough not to drop a replica merely slowed by load)
            url = start(opts, "127.0.0.1", free_port(), replicas=1, actor_options={"num_cpus": 1}, timeout_s=300,
                        deployment_options={"health_check_period_s": 1, "health_check_timeout_s": 15,
                                            "graceful_shutdown_timeout_s": 1})
            with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
                r = client.get("/healthz")
                assert r.headers[ANSWERED_BY] == "proxy", r.headers  # no hop to a replica
                first = r.json()
                assert first["status"] == "ok" and first["replicas"] == {"RUNNING": 1}, first
                assert "arl-sql-health" not in client.get("/-/routes").text  # no health app was deployed
                assert first["databases"] == 2 and first["model"] == str(model)
                pid = client.get("/v1/stats").json()["pid"]
                os.kill(pid, signal.SIGSTOP)
                try:
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        pending = pool.submit(client.get, "/v1/databases")  # the frozen replica cannot answer
                        during = httpx.get(url + "/healthz", timeout=120)  # no key: probes carry none
                        pending_then = not pending.done()
                        assert during.status_code == 200 and during.json()["status"] == "ok", during.text
                        assert pending_then, "the request to the frozen replica was answered: it was not frozen"
                        # kept frozen: the controller's health check times out and it replaces the replica
                        down = _poll(client, 503, 240)
                        assert down.status_code == 503, down.text
                        assert set(down.json()) == {"error"} and "no RUNNING replica" in down.json()["error"]
                        assert "\n" not in down.json()["error"]
                        try:
                            pending.result(timeout=240)  # answered or failed with the replica: bounded
                        except httpx.HTTPError:
                            pass
                finally:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                up = _poll(client, 200, 300)
                assert up.status_code == 200 and up.json()["replicas"].get("RUNNING") == 1, up.text
                assert client.get("/v1/stats").json()["pid"] != pid  # a new replica answers
                assert client.get("/v1/databases").status_code == 200
        finally:
            serve.shutdown()


def test_healthz_verdict_fresh_stale_missing_and_no_running_replica():
    ok = {"app": "RUNNING", "deployment": "HEALTHY", "replicas": {"RUNNING": 2}, "message": ""}
    code, body = verdict(ok, True, 0.5, 15, "", "arl-sql", "SqlService")
    assert code == 200 and body["replicas"] == {"RUNNING": 2} and body["status_age_s"] == 0.5
    one_of_two = {"app": "UNHEALTHY", "deployment": "UNHEALTHY", "replicas": {"RUNNING": 1, "STARTING": 1},
                  "message": "replica died"}
    assert verdict(one_of_two, True, 0.5, 15, "", "arl-sql", "SqlService")[0] == 200  # one still answers
    code, body = verdict(ok, True, 16.0, 15, "RaySystemError: gone", "arl-sql", "SqlService")
    assert code == 503 and "16.0 s old" in body["error"] and "RaySystemError: gone" in body["error"]
    code, body = verdict(None, False, 0.0, 15, "", "arl-sql", "SqlService")
    assert code == 503 and "no status from Ray Serve's controller yet" in body["error"]
    code, body = verdict(None, True, 0.1, 15, "", "arl-sql", "SqlService")
    assert code == 503 and "'arl-sql'" in body["error"] and "not deployed" in body["error"]
    down = {"app": "DEPLOYING", "deployment": "UNHEALTHY", "replicas": {"STARTING": 1, "STOPPING": 1},
            "message": "health check failed"}
    code, body = verdict(down, True, 0.1, 15, "", "arl-sql", "SqlService")
    assert code == 503 and "STARTING: 1, STOPPING: 1" in body["error"] and "health check failed" in body["error"]


def test_summarize_reads_the_controllers_details():
    """The dict the controller sends (Ray Serve's REST schema), with enum members or their values."""
    from ray.serve._private.common import ReplicaState

    details = {"applications": {"arl-sql": {"status": "RUNNING", "message": "", "deployments": {"SqlService": {
        "status": "HEALTHY", "message": "", "replicas": [{"state": ReplicaState.RUNNING}, {"state": "STARTING"}]}}}}}
    assert summarize(details, "arl-sql", "SqlService") == {"app": "RUNNING", "deployment": "HEALTHY",
                                                           "replicas": {"RUNNING": 1, "STARTING": 1}, "message": ""}
    assert summarize(details, "other", "SqlService") is None and summarize({}, "arl-sql", "SqlService") is None
    assert summarize(details, "arl-sql", "Other") is None


def test_proxy_middleware_answers_healthz_and_passes_every_other_request_on():
    """ProxyHealthz as Ray Serve's proxy runs it (an ASGI middleware around the proxy's app), the
    controller a stand-in: /healthz answered from the controller's details (x-arl-healthz: proxy), 503
    once no replica is RUNNING; /healthz/<x> is the key rule, then 404; POST /healthz 405; every other
    path (/healthzz too) reaches the wrapped app untouched. Ray Serve's callback and the settings."""
    import asyncio

    from starlette.responses import PlainTextResponse

    from launch.serve_health import (
        PROXY_CALLBACK,
        PROXY_CALLBACK_ENV,
        SETTINGS_ENV,
        ProxyHealthz,
        proxy_env,
        proxy_middlewares,
    )
    from launch.serve_http import ServeOptions, key_digest

    replicas = [{"state": "RUNNING"}]
    details = {"applications": {"arl-sql": {"status": "RUNNING", "message": "", "deployments": {"SqlService": {
        "status": "HEALTHY", "message": "", "replicas": replicas}}}}}
    seen: list[str] = []

    async def proxy_app(scope, receive, send):
        seen.append(scope["path"])
        await PlainTextResponse("routed")(scope, receive, send)

    settings = {"app": "arl-sql", "deployment": "SqlService", "model": "/m", "databases": 2,
                "api_key_sha256": key_digest(KEY), "poll_s": 0.05, "max_age_s": 15}
    mw = ProxyHealthz(proxy_app, settings, details=lambda: details)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://proxy") as c:
            r = await c.get("/healthz")
            for _ in range(100):  # the first poll (bounded)
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.05)
                r = await c.get("/healthz")
            assert r.status_code == 200 and r.headers[ANSWERED_BY] == "proxy", r.text
            body = r.json()
            assert body["status"] == "ok" and body["model"] == "/m" and body["databases"] == 2
            assert body["replicas"] == {"RUNNING": 1}
            r = await c.get("/healthz/anything")
            assert r.status_code == 401 and "missing API key" in r.json()["error"]
            assert (await c.get("/healthz/anything", headers={"Authorization": f"Bearer {KEY}"})).status_code == 404
            assert (await c.post("/healthz")).status_code == 405
            for path in ("/v1/databases", "/healthzz", "/"):
                r = await c.get(path)
                assert r.text == "routed" and ANSWERED_BY not in r.headers
            replicas[0]["state"] = "STOPPING"
            for _ in range(100):
                r = await c.get("/healthz")
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 503 and "no RUNNING replica" in r.json()["error"], r.text

    try:
        asyncio.run(run())
    finally:
        mw.state.stop()
    assert seen == ["/v1/databases", "/healthzz", "/"]
    opts = ServeOptions(model="/m", bird_dir="/b", api_key_sha256=key_digest(KEY))
    env = proxy_env("arl-sql", "SqlService", opts, 2)
    assert env[PROXY_CALLBACK_ENV] == PROXY_CALLBACK and '"databases": 2' in env[SETTINGS_ENV]
    os.environ[PROXY_CALLBACK_ENV] = "their.module:callback"  # the user's own: left alone (the health app answers)
    try:
        assert proxy_env("arl-sql", "SqlService", opts, 2) == {}
    finally:
        del os.environ[PROXY_CALLBACK_ENV]
    assert os.environ.get(SETTINGS_ENV) is None and proxy_middlewares() == []
