"""launch.serve's `GET /healthz`: a Ray Serve application of its own, so a probe never waits behind inference.

The model replicas (launch/serve.py's SqlService) run generation and SQL; a route of theirs waits for
their CPU, their event loop and their request queue (measured under 64 clients: /healthz p50 434 ms,
max 2.3 s). This deployment (`HealthProbe`, app `arl-sql-health`, route prefix `/healthz`, no CPU
reserved) answers from memory what Ray Serve's controller last said about the model deployment; a
daemon thread asks the controller for its status (what `serve.status()` reads) every `health_poll_s`. The proxy sends /healthz
here by its longest-prefix rule and every other path to the model app at `/`.

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
- Like the model replicas, this one binds Serve's inter-deployment gRPC server to loopback on our own
  cluster (launch/serve_life.py replica_grpc_on_loopback).
- /healthz never needs the API key (probes carry none); any other path under the prefix does, exactly
  as every route of the model app (401, launch/serve_http.py auth_refusal), and is then a 404; a method
  other than GET/HEAD on /healthz is a 405. Bodies are one line under "error", as everywhere.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from launch.serve_http import _error, auth_refusal, find_databases

HEALTH_APP = "arl-sql-health"
HEALTH_PREFIX = "/healthz"
FIRST_STATUS_S = 30.0  # the constructor waits at most this for the controller's first answer


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


@serve.deployment(name="HealthProbe", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class HealthProbe:
    def __init__(self, app: str, deployment: str, model: str, bird_dir: str, split: str, api_key_sha256: str,
                 poll_s: float = 1.0, max_age_s: float = 15.0):
        from launch.serve_life import replica_grpc_on_loopback

        replica_grpc_on_loopback()  # this replica's gRPC server too: the proxy stays the one exposed socket
        self.app, self.deployment, self.poll_s, self.max_age_s = app, deployment, poll_s, max_age_s
        self.info = {"model": model, "databases": len(find_databases(bird_dir, split))}
        self.digest = api_key_sha256
        self.summary: dict | None = None
        self.polled_at: float | None = None  # time.monotonic() of the last answer from the controller
        self.last_error = ""
        self._first, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._poll, name="healthz-poll", daemon=True).start()
        self._first.wait(FIRST_STATUS_S)  # bounded; without an answer /healthz says so (503)

    def _poll(self) -> None:
        from queues.errors import one_line

        while not self._stop.is_set():
            try:
                summary = summarize(controller_details(), self.app, self.deployment)
                self.summary, self.polled_at, self.last_error = summary, time.monotonic(), ""
            except Exception as e:  # noqa: BLE001  (the controller away: the status ages, /healthz says so)
                self.last_error = one_line(e)
            self._first.set()
            self._stop.wait(self.poll_s)

    def __del__(self):
        self._stop.set()

    async def __call__(self, request: Request) -> Response:
        path = request.scope.get("path", "")
        root = request.scope.get("root_path", "")
        rest = (path[len(root):] if root and path.startswith(root) else path).rstrip("/")
        if rest not in ("", HEALTH_PREFIX):  # /healthz/<anything>: the key rule, then 404
            why = auth_refusal(self.digest, request.headers.get("authorization"))
            if why:
                response = _error(401, why)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            return _error(404, f"Not Found: {request.method} {path}")
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"Method Not Allowed: {request.method} {path}")
        age = time.monotonic() - self.polled_at if self.polled_at is not None else 0.0
        code, body = verdict(self.summary, self.polled_at is not None, age, self.max_age_s, self.last_error,
                             self.app, self.deployment)
        if code == 200:
            body = {"status": "ok", **self.info, **{k: v for k, v in body.items() if k != "status"}}
        return JSONResponse(body, status_code=code)


def build_health(app: str, deployment: str, opts) -> Any:
    """The bound HealthProbe for launch.serve's options (a ServeOptions)."""
    return HealthProbe.bind(app, deployment, opts.model, opts.bird_dir, opts.split, opts.api_key_sha256,
                            opts.health_poll_s, opts.health_max_age_s)
