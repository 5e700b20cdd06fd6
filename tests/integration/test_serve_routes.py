"""Ray Serve's proxy answers `/-/routes` (every route prefix and the app behind it) itself; with an API key
set, launch.serve's proxy middleware (launch/serve_health.py ProxyRoutesKey) asks for the key there as on
every route of the model app: 401 with one line without it, the proxy's answer with it. Without a key the
service is loopback only and /-/routes stays as Ray answers it. The middleware as an ASGI app (no Ray), and
for real: a local Ray started with the CLI's proxy settings, Ray Serve's own proxy, a one-line app."""
import asyncio
import time

import pytest

from launch.serve_health import (
    SETTINGS_ENV,
    ProxyHealthz,
    ProxyRoutesKey,
    proxy_env,
    proxy_middlewares,
)
from launch.serve_http import ServeOptions, key_digest
from tests.clusters import ray_cluster

httpx = pytest.importorskip("httpx")

KEY = "k3y-for-the-routes-tests"


def _routed(seen: list[str]):
    from starlette.responses import PlainTextResponse

    async def proxy_app(scope, receive, send):
        seen.append(scope["path"])
        await PlainTextResponse("routed")(scope, receive, send)
    return proxy_app


def _get(app, path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            return await c.get(path, headers=headers or {})
    return asyncio.run(go())


def test_routes_need_the_key_when_one_is_set_and_everything_else_passes_untouched():
    seen: list[str] = []
    mw = ProxyRoutesKey(_routed(seen), {"api_key_sha256": key_digest(KEY)})
    for headers, reason in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "wrong API key"),
                            ({"Authorization": f"Token {KEY}"}, "unsupported authorization scheme")):
        for path in ("/-/routes", "/-/routes/"):
            r = _get(mw, path, headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers, r.text)
            assert set(r.json()) == {"error"} and reason in r.json()["error"]
    assert seen == []  # refused before the proxy's own answer
    assert _get(mw, "/-/routes", {"Authorization": f"Bearer {KEY}"}).text == "routed"
    for path in ("/-/healthz", "/healthz", "/v1/databases", "/-/routesx"):  # not this middleware's to judge
        assert _get(mw, path).text == "routed"
    assert seen == ["/-/routes", "/-/healthz", "/healthz", "/v1/databases", "/-/routesx"]
    open_mw = ProxyRoutesKey(_routed(seen), {"api_key_sha256": ""})  # no key: loopback only, Ray's answer
    assert _get(open_mw, "/-/routes").text == "routed"


def test_the_proxy_callback_installs_the_routes_key_with_our_settings(monkeypatch):
    opts = ServeOptions(model="/m", bird_dir="/b", api_key_sha256=key_digest(KEY))
    for k, v in proxy_env("arl-sql", "SqlService", opts, 2).items():
        monkeypatch.setenv(k, v)
    assert [m.cls for m in proxy_middlewares()] == [ProxyRoutesKey, ProxyHealthz]
    assert ProxyRoutesKey(None).digest == key_digest(KEY)
    monkeypatch.delenv(SETTINGS_ENV)
    assert proxy_middlewares() == []


def test_ray_serves_own_routes_answer_needs_the_key_through_the_real_proxy(monkeypatch):
    """A local Ray started with the CLI's proxy settings (key set): GET /-/routes without the key is 401 and
    names no app; with it, Ray's answer names the app; /-/healthz stays open for probes."""
    from ray import serve
    from starlette.requests import Request

    from tests.net import free_port

    opts = ServeOptions(model="/m", bird_dir="/b", api_key_sha256=key_digest(KEY))
    for k, v in proxy_env("arl-sql", "SqlService", opts, 2).items():  # before Ray starts, as the CLI does
        monkeypatch.setenv(k, v)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Hello:
        async def __call__(self, request: Request) -> str:
            return "hello"

    port = free_port()
    with ray_cluster("ray-serve-routes-"):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(Hello.bind(), name="arl-sql-routes-app", route_prefix="/", blocking=False)
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=60) as c:
                r = c.get("/-/routes")
                for _ in range(300):  # the proxy comes up with the app (bounded)
                    if r.status_code != 404 and "arl-sql-routes-app" in c.get(
                            "/-/routes", headers={"Authorization": f"Bearer {KEY}"}).text:
                        break
                    time.sleep(0.2)
                    r = c.get("/-/routes")
                assert r.status_code == 401 and "missing API key" in r.json()["error"], r.text
                assert "arl-sql-routes-app" not in r.text
                keyed = c.get("/-/routes", headers={"Authorization": f"Bearer {KEY}"})
                assert keyed.status_code == 200 and keyed.json() == {"/": "arl-sql-routes-app"}
                assert c.get("/-/healthz").status_code == 200
        finally:
            serve.shutdown()
