"""launch.serve's `GET /healthz`: answered in Ray Serve's HTTP proxy itself, or by an application of its own,
never by a model replica, so a probe never waits behind inference.

The model replicas (launch/serve_app.py's SqlService) run generation and SQL; a route of theirs waits for
their CPU, their event loop and their request queue (measured under 64 clients: /healthz p50 434 ms,
max 2.3 s). Even a replica that does no work costs a hop from the proxy (its event loop, Ray's core
worker and gRPC, the replica's loop and back: p99 0.5-1.5 s on the loaded 2 cores, against 40-150 ms for
a route the proxy answers itself; docs/RELIABILITY.md). So /healthz is answered where it arrives:
- In the proxy (`ProxyHealthz`, an ASGI middleware), when the proxy was started with our callback:
  Ray Serve's proxy calls `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (`proxy_middlewares`) once at its
  start and wraps its app in what it returns; `proxy_env` gives those variables (and our settings, under
  ARL_SERVE_HEALTHZ), which the proxy inherits when they are in the environment before Ray starts, as
  launch.serve's CLI sets them for the cluster it starts. Its answers carry `x-arl-healthz: proxy`.
- Otherwise (a cluster joined with --ray-address, a proxy started without the callback) by the
  `HealthProbe` deployment (app `arl-sql-health`, route prefix `/healthz`, no CPU reserved), which the
  proxy sends /healthz to by its longest-prefix rule; `x-arl-healthz: replica`. launch/serve_app.py's
  `start` asks /healthz once after the model app is up and deploys this app only when the proxy did
  not answer it.
Both answer from memory (`HealthState`: a daemon thread asks the controller for its status, what
`serve.status()` reads, every `health_poll_s`) with the same rule and the same bodies.

What it checks, and its invariant:
- 200 {"status": "ok", "model", "databases", "replicas": {state: count}, "deployment", "status_age_s"}
  if and only if the controller's last answer, at most `health_max_age_s` old, counted at least one
  RUNNING replica of the model deployment. A RUNNING replica is one the controller started (its
  constructor loaded the model, the SQL sandbox and the databases) and whose health check passes: the
  controller calls SqlService.check_health every `health_check_period_s` and replaces a replica that
  raises or does not answer within `health_check_timeout_s` (a dead or hung replica stops counting as
  RUNNING then; Ray Serve's defaults: 10 s and 30 s).
- Otherwise 503 {"error": "<one line>"}: no answer from the controller yet or for too long (the age
  and the last error), the app not deployed, or no RUNNING replica (the states and the controller's
  message). So /healthz is as fresh as `health_poll_s` plus the controller's own health-check bounds,
  and a busy replica (answering its health check, slow on requests) is alive, as a liveness probe means.
- Like the model replicas, the HealthProbe replica binds Serve's inter-deployment gRPC server to
  loopback on our own cluster (launch/serve_life.py replica_grpc_on_loopback).
- /healthz never needs the API key (probes carry none); any other path under the prefix does, exactly
  as every route of the model app (401, launch/serve_http.py auth_refusal), and is then a 404; a method
  other than GET/HEAD on /healthz is a 405. Bodies are one line under "error", as everywhere.
- Ray Serve's proxy answers `/-/routes` itself (every route prefix and the app behind it): with a key
  set, the proxy's middleware (`ProxyRoutesKey`, beside ProxyHealthz) asks for the key there too, so
  nothing but /healthz and the proxy's bare `/-/healthz` ("success") answers without it. A proxy started
  without our callback (a joined cluster, the user's own callback) still answers it openly.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from launch.serve_http import _error, auth_refusal, find_databases

MODEL_APP, MODEL_DEPLOYMENT = "arl-sql", "SqlService"  # launch/serve_app.py's application and deployment
HEALTH_APP = "arl-sql-health"
HEALTH_PREFIX = "/healthz"
FIRST_STATUS_S = 30.0  # the HealthProbe's constructor waits at most this for the controller's first answer
ANSWERED_BY = "x-arl-healthz"  # response header: "proxy" or "replica"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # read by Ray Serve's proxy at its start
PROXY_CALLBACK = "launch.serve_health:proxy_middlewares"
SETTINGS_ENV = "ARL_SERVE_HEALTHZ"  # JSON: what ProxyHealthz answers about (proxy_env)


def _name(v: Any) -> str:
    return str(getattr(v, "value", v))  # an enum member or its value


def controller_details() -> dict:
    """The controller's ServeInstanceDetails as the plain dict it sends (Ray Serve's REST schema): the
    call serve.status() makes, without its pydantic parse (measured idle: 0.5 against 8 ms of CPU per
    call, time this replica's event loop would not answer /healthz)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


def summarize(details: dict, app: str, deployment: str) -> dict | None:
    """What /healthz needs from the controller's details: the app's and the deployment's status, replica
    counts by state and the controller's messages; None when the app (or its deployment) is not deployed."""
    a = (details.get("applications") or {}).get(app)
    if a is None or deployment not in (a.get("deployments") or {}):
        return None
    d = a["deployments"][deployment]
    replicas: dict[str, int] = {}
    for r in d.get("replicas") or []:
        replicas[_name(r.get("state"))] = replicas.get(_name(r.get("state")), 0) + 1
    return {"app": _name(a.get("status")), "deployment": _name(d.get("status")), "replicas": replicas,
            "message": " ".join(m for m in (a.get("message"), d.get("message")) if m)}


def verdict(summary: dict | None, polled: bool, age_s: float, max_age_s: float, last_error: str,
            app: str, deployment: str) -> tuple[int, dict]:
    """(HTTP status, body) of /healthz from the last controller answer (`polled`: one has come; `age_s`
    since it came). Pure: the invariant of the module docstring, testable without Ray."""
    why = f" (last error: {last_error})" if last_error else ""
    if not polled:
        return 503, {"error": f"no status from Ray Serve's controller yet{why}"}
    if age_s > max_age_s:
        return 503, {"error": f"the last status from Ray Serve's controller is {age_s:.1f} s old "
                              f"(the bound is {max_age_s:g} s){why}"}
    if summary is None:
        return 503, {"error": f"application {app!r} (deployment {deployment!r}) is not deployed"}
    running = summary["replicas"].get("RUNNING", 0)
    if running < 1:
        states = ", ".join(f"{k}: {n}" for k, n in sorted(summary["replicas"].items())) or "none"
        msg = f"; {summary['message']}" if summary["message"] else ""
        return 503, {"error": f"deployment {deployment!r} has no RUNNING replica (replicas {states}; "
                              f"deployment {summary['deployment']}){msg}"[:500]}
    return 200, {"status": "ok", "replicas": summary["replicas"], "deployment": summary["deployment"],
                 "status_age_s": round(age_s, 3)}


class HealthState:
    """The controller's last word on the model deployment: a daemon thread asks every `poll_s` (the
    first answer waited for at most `first_wait_s`); `answer()` is /healthz's (status, body) from memory.
    `details` is what it asks (controller_details; a stand-in in tests)."""

    def __init__(self, app: str, deployment: str, info: dict, poll_s: float = 1.0, max_age_s: float = 15.0,
                 first_wait_s: float = 0.0, details=controller_details):
        self._details = details
        self.app, self.deployment, self.info, self.poll_s, self.max_age_s = app, deployment, info, poll_s, max_age_s
        self.summary: dict | None = None
        self.polled_at: float | None = None  # time.monotonic() of the last answer from the controller
        self.last_error = ""
        self._first, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._poll, name="healthz-poll", daemon=True).start()
        self._first.wait(first_wait_s)  # bounded; without an answer /healthz says so (503)

    def _poll(self) -> None:
        from queues.errors import one_line

        while not self._stop.is_set():
            try:
                summary = summarize(self._details(), self.app, self.deployment)
                self.summary, self.polled_at, self.last_error = summary, time.monotonic(), ""
            except Exception as e:  # noqa: BLE001  (the controller away: the status ages, /healthz says so)
                self.last_error = one_line(e)
            self._first.set()
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()

    def answer(self) -> tuple[int, dict]:
        age = time.monotonic() - self.polled_at if self.polled_at is not None else 0.0
        code, body = verdict(self.summary, self.polled_at is not None, age, self.max_age_s, self.last_error,
                             self.app, self.deployment)
        if code == 200:
            body = {"status": "ok", **self.info, **{k: v for k, v in body.items() if k != "status"}}
        return code, body


def respond(state: HealthState, digest: str, method: str, path: str, authorization: str | None,
            answered_by: str) -> Response:
    """The response to `method path` (a path under HEALTH_PREFIX, the prefix included) by the module's rules."""
    if path.rstrip("/") != HEALTH_PREFIX:  # /healthz/<anything>: the key rule, then 404
        why = auth_refusal(digest, authorization)
        if why:
            response = _error(401, why)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return _error(404, f"Not Found: {method} {path}")
    if method not in ("GET", "HEAD"):
        return _error(405, f"Method Not Allowed: {method} {path}")
    code, body = state.answer()
    return JSONResponse(body, status_code=code, headers={ANSWERED_BY: answered_by})


@serve.deployment(name="HealthProbe", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class HealthProbe:
    def __init__(self, app: str, deployment: str, model: str, bird_dir: str, split: str, api_key_sha256: str,
                 poll_s: float = 1.0, max_age_s: float = 15.0):
        from launch.serve_life import replica_grpc_on_loopback

        replica_grpc_on_loopback()  # this replica's gRPC server too: the proxy stays the one exposed socket
        self.digest = api_key_sha256
        self.state = HealthState(app, deployment, {"model": model, "databases": len(find_databases(bird_dir, split))},
                                 poll_s, max_age_s, first_wait_s=FIRST_STATUS_S)

    def __del__(self):
        state = getattr(self, "state", None)
        if state is not None:
            state.stop()

    async def __call__(self, request: Request) -> Response:
        path = request.scope.get("path", "")
        root = request.scope.get("root_path", "")
        rest = (path[len(root):] if root and path.startswith(root) else path) or HEALTH_PREFIX
        if not rest.startswith(HEALTH_PREFIX):  # the proxy strips nothing here; a root path may be cut off
            rest = HEALTH_PREFIX + rest
        return respond(self.state, self.digest, request.method, rest, request.headers.get("authorization"), "replica")


class ProxyHealthz:
    """ASGI middleware in Ray Serve's proxy: /healthz and paths under it answered there (no replica
    hop), every other request passed on untouched. Its settings come from ARL_SERVE_HEALTHZ."""

    def __init__(self, app, settings: dict | None = None, details=controller_details):
        cfg = settings if settings is not None else json.loads(os.environ[SETTINGS_ENV])
        self.app, self.digest = app, cfg["api_key_sha256"]
        self.state = HealthState(cfg["app"], cfg["deployment"], {"model": cfg["model"], "databases": cfg["databases"]},
                                 cfg["poll_s"], cfg["max_age_s"], details=details)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if path != HEALTH_PREFIX and not path.startswith(HEALTH_PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        auth = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        await respond(self.state, self.digest, scope.get("method", "GET"), path, auth, "proxy")(scope, receive, send)


PROXY_KEYED_PATHS = ("/-/routes",)  # the proxy's own routes that tell more than "success"


class ProxyRoutesKey:
    """ASGI middleware in Ray Serve's proxy: with a key set, `/-/routes` (the proxy's own answer naming
    every app) refused with the model app's 401 unless the request carries the key; every other request
    passed on untouched. Its settings come from ARL_SERVE_HEALTHZ (api_key_sha256; "" -> no key)."""

    def __init__(self, app, settings: dict | None = None):
        cfg = settings if settings is not None else json.loads(os.environ[SETTINGS_ENV])
        self.app, self.digest = app, cfg["api_key_sha256"]

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").rstrip("/") if scope.get("type") == "http" else ""
        if self.digest and path in PROXY_KEYED_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            why = auth_refusal(self.digest, auth)
            if why:
                response = _error(401, why)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def proxy_middlewares() -> list:
    """PROXY_CALLBACK: Ray Serve's proxy calls it once at its start; ProxyHealthz and ProxyRoutesKey when our
    settings are set."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyRoutesKey), Middleware(ProxyHealthz)] if os.environ.get(SETTINGS_ENV) else []


def proxy_env(app: str, deployment: str, opts, databases: int) -> dict[str, str]:
    """The variables that make a proxy started after them (its Ray cluster started after them, so
    that its processes inherit them) answer /healthz itself for `app`'s `deployment`; {} when the
    environment already names another proxy callback (the HealthProbe app answers then)."""
    if os.environ.get(PROXY_CALLBACK_ENV, PROXY_CALLBACK) != PROXY_CALLBACK:
        return {}
    settings = {"app": app, "deployment": deployment, "model": opts.model, "databases": databases,
                "api_key_sha256": opts.api_key_sha256, "poll_s": opts.health_poll_s, "max_age_s": opts.health_max_age_s}
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK, SETTINGS_ENV: json.dumps(settings)}


def proxy_answers(host: str, port: int, timeout_s: float = 60.0) -> bool:
    """Whether the proxy at host:port answers /healthz itself: True once it does with a 200 (bounded:
    TimeoutError with its last answer after `timeout_s`), False at once when another answers or none."""
    import urllib.error
    import urllib.request

    h = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    url = f"http://{f'[{h}]' if ':' in h else h}:{port}{HEALTH_PREFIX}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an HTTP proxy of the environment
    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        try:
            with opener.open(url, timeout=max(1.0, timeout_s)) as r:
                return r.headers.get(ANSWERED_BY) == "proxy"
        except urllib.error.HTTPError as e:
            if e.headers.get(ANSWERED_BY) != "proxy":
                return False
            last = f"{e.code} {e.read().decode(errors='replace')[:300]}"
        except OSError:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"/healthz, answered by Ray Serve's proxy, still said {last} after {timeout_s:g} s")
        time.sleep(0.2)


def build_health(app: str, deployment: str, opts) -> Any:
    """The bound HealthProbe for launch.serve's options (a ServeOptions)."""
    return HealthProbe.bind(app, deployment, opts.model, opts.bird_dir, opts.split, opts.api_key_sha256,
                            opts.health_poll_s, opts.health_max_age_s)
