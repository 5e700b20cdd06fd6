"""The service under load: C concurrent HTTP clients for D seconds against `python -m launch.serve`, a
tenth of them hostile, and a /healthz probe beside them.

    .venv/bin/python -m bench.serve.load --clients 64 --seconds 300 --replicas 1,2 --json /tmp/serve_load.json
    .venv/bin/python -m bench.serve.load --clients 6 --seconds 10    # what tests/e2e/test_serve_load.py runs

Without --model it builds the tests' tiny export (tests/tiny_export.py) under a temp dir. For each
--replicas value the service is started as a user starts it (`python -m launch.serve ... --replicas R`,
its own local Ray, a free loopback port), and stopped with SIGTERM after the load.

Clients run in one asyncio loop (httpx), each in a closed loop (its next request when the last one is
answered). An ordinary client asks, in turn: POST /v1/sql (execute), POST /v1/chat/completions, POST
/v1/execute (a dev question's gold SQL), GET /v1/databases, GET /v1/models. A hostile client (every
tenth; at least one) sends, in turn, every entry of bench.hostile.HOSTILE_SQL to /v1/execute (endless
recursive CTEs, writes, stacked statements, ATTACH, a 5 M-row result, a ~100 kB query) and malformed
requests (a body over the cap, an over-long question, max_turns out of range, bad JSON, an unknown
database, a streamed chat completion). The probe, a process of its own (as a load balancer's is), GETs
/healthz every 0.25 s.

Reported (JSON and markdown): per route, requests, p50 / p99 / max latency and status counts; every
5xx and every client-side error (a timeout or a dropped connection counts as one: nothing is allowed to
hang); the hostile clients' statuses and verdicts by kind; /healthz's p50 / p99 / max under the load (and
how many answers took over 100 ms), its p50 / max on the idle service just before (what the machine's own
load costs it), who answered it (Ray Serve's proxy itself or the health app's replica: the
x-arl-healthz header), the proxy's own /-/healthz beside it (no replica: the floor for any route), and
how far the probe's own 0.25 s sleeps overran (its own wait for a CPU: the control), with every tick
where either route took over 100 ms. The verdict the
bench gives (exit 0): no 5xx, no client error, each hostile request answered with a 4xx or a 200 whose
verdict is not "ok" (the sandbox refused it or cut it short).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.hostile import HOSTILE_SQL, huge_text
from bench.outputs import add_report_args, work_dir, write_reports
from bench.serve.batching import percentile

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_FRACTION = 0.1
HEALTHZ_EVERY_S = 0.25
CLIENT_TIMEOUT_S = 300.0  # the service's own bounds (request 120 s, SQL 10 s) are far below it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostile_requests(db: str) -> list[tuple[str, str, str, object]]:
    """(kind, method, path, body) — body a dict (sent as JSON) or raw bytes."""
    out: list[tuple[str, str, str, object]] = [
        (f"sql:{k}", "POST", "/v1/execute", {"db_id": db, "sql": sql}) for k, sql in HOSTILE_SQL.items()]
    out += [
        ("max_turns_999", "POST", "/v1/sql", {"db_id": db, "question": "How many?", "max_turns": 999}),
        ("body_over_cap", "POST", "/v1/sql", {"db_id": db, "question": huge_text(1 << 20)}),
        ("question_too_long", "POST", "/v1/sql", {"db_id": db, "question": huge_text(3000)}),
        ("bad_json", "POST", "/v1/execute", b"{\"db_id\": "),
        ("unknown_db", "POST", "/v1/execute", {"db_id": "../../etc/passwd", "sql": "SELECT 1"}),
        ("chat_stream", "POST", "/v1/chat/completions", {"model": f"arl-sql/{db}", "stream": True,
                                                         "messages": [{"role": "user", "content": "x"}]}),
    ]
    return out


def ordinary_requests(questions, model_id: str = "arl-sql") -> list[tuple[str, str, str, object]]:
    out = []
    for q in questions:
        out += [
            ("sql", "POST", "/v1/sql", {"db_id": q.db_id, "question": q.question, "evidence": q.evidence, "execute": True}),
            ("chat", "POST", "/v1/chat/completions", {"model": f"{model_id}/{q.db_id}",
                                                      "messages": [{"role": "user", "content": q.question}]}),
            ("execute", "POST", "/v1/execute", {"db_id": q.db_id, "sql": q.sql}),
            ("databases", "GET", "/v1/databases", None),
            ("models", "GET", "/v1/models", None),
        ]
    return out


class Tally:
    def __init__(self):
        self.lat: dict[str, list[float]] = {}
        self.status: dict[str, dict[str, int]] = {}
        self.errors: list[str] = []
        self.server_errors: list[str] = []
        self.hostile: dict[str, dict[str, int]] = {}
        self.hostile_ok: list[str] = []  # hostile requests answered 200 with verdict "ok": should not happen

    def add(self, route: str, seconds: float, status: int | str) -> None:
        self.lat.setdefault(route, []).append(seconds)
        counts = self.status.setdefault(route, {})
        counts[str(status)] = counts.get(str(status), 0) + 1


async def _client(http, reqs, hostile: bool, stop_at: float, tally: Tally, offset: int) -> None:
    i = offset
    while time.monotonic() < stop_at:
        kind, method, path, body = reqs[i % len(reqs)]
        i += 1
        kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        t = time.perf_counter()
        try:
            r = await http.request(method, path, **kw)
            status: int | str = r.status_code
        except Exception as e:  # noqa: BLE001 - a timeout or dropped connection: reported, never hidden
            status = type(e).__name__
            tally.errors.append(f"{method} {path} ({kind}): {type(e).__name__}: {str(e)[:120]}")
            r = None
        dt = time.perf_counter() - t
        route = f"{method} {path}" + (" (hostile)" if hostile else "")
        tally.add(route, dt, status)
        if r is not None and r.status_code >= 500:
            tally.server_errors.append(f"{route} {kind}: {r.status_code} {r.text[:200]}")
        if hostile:
            verdict = ""
            if r is not None and r.status_code == 200:
                try:
                    verdict = r.json().get("verdict", "")
                except ValueError:
                    verdict = "?"
                if verdict == "ok":
                    tally.hostile_ok.append(kind)
            h = tally.hostile.setdefault(kind, {})
            key = f"{status}" + (f" {verdict}" if verdict else "")
            h[key] = h.get(key, 0) + 1


def _probe(url: str, idle_until: float, stop_at: float, out) -> None:
    """GET /healthz every HEALTHZ_EVERY_S until `stop_at` (time.monotonic(), the same clock in every
    process), in a process of its own as a load balancer's or kubelet's probe is: the load generator's
    event loop is not in its latency. Each tick also GETs Ray Serve's proxy's own `/-/healthz` (answered
    in the proxy, no replica: the floor this machine gives any route). Puts ({"idle": [s], "load": [s],
    "proxy_idle": [s], "proxy_load": [s], "loadavg": [1-minute load average at each tick under load],
    "oversleep": [s the probe's own 0.25 s sleep overran under load: its own wait for a CPU, the control]},
    failures, {who answered /healthz (its x-arl-healthz header): count}) on `out`."""
    import httpx

    lat: dict[str, list[float]] = {"idle": [], "load": [], "proxy_idle": [], "proxy_load": [], "loadavg": [],
                                   "oversleep": []}
    failures: list[str] = []
    by: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        while time.monotonic() < stop_at:
            phase = "idle" if time.monotonic() < idle_until else "load"
            if phase == "load":
                lat["loadavg"].append(os.getloadavg()[0])
            for path, key in (("/healthz", phase), ("/-/healthz", f"proxy_{phase}")):
                t = time.perf_counter()
                try:
                    r = http.get(path)
                    if r.status_code != 200:
                        failures.append(f"{path} {r.status_code}")
                    if path == "/healthz":
                        who = r.headers.get("x-arl-healthz", "?")
                        by[who] = by.get(who, 0) + 1
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{path} {type(e).__name__}")
                lat[key].append(time.perf_counter() - t)
            t = time.perf_counter()
            time.sleep(HEALTHZ_EVERY_S)
            if phase == "load":
                lat["oversleep"].append(time.perf_counter() - t - HEALTHZ_EVERY_S)
    out.put((lat, failures, by))


async def load(url: str, questions, clients: int, seconds: float, hostile_fraction: float = HOSTILE_FRACTION) -> dict:
    import httpx

    db = questions[0].db_id
    n_hostile = max(1, round(clients * hostile_fraction))
    ordinary, hostile = ordinary_requests(questions), hostile_requests(db)
    tally = Tally()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    # /healthz of the idle service first: what the machine alone costs it (a shared machine's load)
    idle_until = time.monotonic() + min(10.0, seconds / 4)
    stop_at = idle_until + seconds
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    prober = ctx.Process(target=_probe, args=(url, idle_until, stop_at, out), daemon=True)
    prober.start()
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        await asyncio.sleep(max(0.0, idle_until - time.monotonic()))
        start = time.perf_counter()
        await asyncio.gather(*(_client(http, hostile if c < n_hostile else ordinary, c < n_hostile, stop_at, tally, 7 * c)
                               for c in range(clients)))
        wall = time.perf_counter() - start
    try:
        lat, health_fail, answered_by = out.get(timeout=CLIENT_TIMEOUT_S + 60)  # its last request is bounded too
    except queue.Empty:
        lat, health_fail, answered_by = {}, ["the /healthz probe process gave no result"], {}
    prober.join(10)
    idle, healthz, proxy = lat.get("idle", []), lat.get("load", []), lat.get("proxy_load", [])
    loadavg = lat.get("loadavg") or [os.getloadavg()[0]]
    over = lat.get("oversleep") or [0.0]
    slow = [i for i, (a, b) in enumerate(zip(healthz, proxy)) if a > 0.1 or b > 0.1]
    routes = {}
    for route, lat in sorted(tally.lat.items()):
        routes[route] = {"n": len(lat), "p50_ms": round(1000 * percentile(lat, 0.5)), "p99_ms": round(1000 * percentile(lat, 0.99)),
                         "max_ms": round(1000 * max(lat)), "status": tally.status[route]}
    return {"clients": clients, "hostile_clients": n_hostile, "seconds": round(wall, 1),
            "requests": sum(len(v) for v in tally.lat.values()),
            "loadavg_min_max": [round(min(loadavg), 1), round(max(loadavg), 1)],
            "rps": round(sum(len(v) for v in tally.lat.values()) / wall, 1), "routes": routes,
            "server_errors": tally.server_errors, "client_errors": tally.errors, "hostile": tally.hostile,
            "hostile_answered_ok": tally.hostile_ok,
            "healthz": {"n": len(healthz), "p50_ms": round(1000 * percentile(healthz, 0.5), 1) if healthz else None,
                        "p90_ms": round(1000 * percentile(healthz, 0.9), 1) if healthz else None,
                        "p99_ms": round(1000 * percentile(healthz, 0.99), 1) if healthz else None,
                        "max_ms": round(1000 * max(healthz), 1) if healthz else None, "failures": health_fail,
                        "answered_by": answered_by,
                        "idle_p50_ms": round(1000 * percentile(idle, 0.5), 1) if idle else None,
                        "idle_max_ms": round(1000 * max(idle), 1) if idle else None,
                        "over_100ms": sum(x > 0.1 for x in healthz),
                        "proxy_p50_ms": round(1000 * percentile(proxy, 0.5), 1) if proxy else None,
                        "proxy_p99_ms": round(1000 * percentile(proxy, 0.99), 1) if proxy else None,
                        "proxy_max_ms": round(1000 * max(proxy), 1) if proxy else None,
                        "probe_oversleep_p99_ms": round(1000 * percentile(over, 0.99), 1),
                        "probe_oversleep_max_ms": round(1000 * max(over), 1),
                        # every tick where /healthz or /-/healthz took over 100 ms: both (ms) and the
                        # probe's own oversleep just after (ms): one stall of the host, or one route?
                        "slow_ticks": [[round(1000 * healthz[i]), round(1000 * proxy[i]),
                                        round(1000 * over[i]) if i < len(over) else None] for i in slow]}}


class Service:
    """`python -m launch.serve` in its own session; ready when it prints its `ready:` line."""

    def __init__(self, model: Path, bird: Path, replicas: int, log_path: Path, start_timeout_s: float = 900.0,
                 extra_args: tuple[str, ...] = ()):
        self.port = _free_port()
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.serve", "--model", str(model), "--bird-dir", str(bird), "--split", "dev",
             "--port", str(self.port), "--replicas", str(replicas), "--engine", "transformers", "--device", "cpu",
             "--start-timeout", str(start_timeout_s), *extra_args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.log_path = log_path
        deadline = time.monotonic() + start_timeout_s + 60
        while b"ready: serving" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"launch.serve did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def verdict(r: dict) -> list[str]:
    """What is wrong with one load's result (empty: it passed)."""
    bad = [f"5xx: {e}" for e in r["server_errors"][:5]] + [f"client error: {e}" for e in r["client_errors"][:5]]
    bad += [f"hostile {k} answered 200 ok" for k in sorted(set(r["hostile_answered_ok"]))]
    for kind, counts in r["hostile"].items():
        for key in counts:
            if not (key.startswith("4") or (key.startswith("200 ") and not key.endswith(" ok"))):
                bad.append(f"hostile {kind}: {key}")
    bad += [f"healthz: {f}" for f in r["healthz"]["failures"][:5]]
    return bad


def markdown(results: list[dict]) -> str:
    out = ["| replicas | route | requests | p50 ms | p99 ms | max ms | statuses |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for route, v in r["routes"].items():
            st = ", ".join(f"{k}: {n}" for k, n in sorted(v["status"].items()))
            out.append(f"| {r['replicas']} | {route} | {v['n']} | {v['p50_ms']} | {v['p99_ms']} | {v['max_ms']} | {st} |")
    out += ["", "| replicas | clients (hostile) | seconds | load avg (min-max) | requests/s | 5xx | client errors |"
            " /healthz p50 / p90 / p99 / max ms | /healthz over 100 ms | answered by | /healthz idle p50 / max ms |"
            " proxy's /-/healthz p50 / p99 / max ms | probe's own 0.25 s sleep overrun p99 / max ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        h = r["healthz"]
        lo, hi = r.get("loadavg_min_max") or ("?", "?")
        by = ", ".join(f"{k}: {n}" for k, n in sorted((h.get("answered_by") or {}).items()))
        out.append(f"| {r['replicas']} | {r['clients']} ({r['hostile_clients']}) | {r['seconds']} | {lo}-{hi} | {r['rps']} | "
                   f"{len(r['server_errors'])} | {len(r['client_errors'])} | {h['p50_ms']} / {h.get('p90_ms')} / "
                   f"{h['p99_ms']} / {h['max_ms']} | {h.get('over_100ms')} of {h['n']} | {by} |"
                   f" {h['idle_p50_ms']} / {h['idle_max_ms']} |"
                   f" {h.get('proxy_p50_ms')} / {h.get('proxy_p99_ms')} / {h.get('proxy_max_ms')} |"
                   f" {h.get('probe_oversleep_p99_ms')} / {h.get('probe_oversleep_max_ms')} |")
    out += ["", "| replicas | hostile request | answers (status verdict: count) |", "|---|---|---|"]
    for r in results:
        for kind, counts in sorted(r["hostile"].items()):
            out.append(f"| {r['replicas']} | {kind} | " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--bird-dir", default="")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--replicas", default="1,2")
    p.add_argument("--hostile-fraction", type=float, default=HOSTILE_FRACTION)
    p.add_argument("--work-dir", default="")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for launch.serve, e.g. --serve-arg=--replica-nice=0 (repeatable)")
    add_report_args(p)
    a = p.parse_args(argv)
    from tasks.bird import load_split

    work = work_dir(a.work_dir, "arl-serve-load-")
    if a.model:
        model, bird = Path(a.model), Path(a.bird_dir)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.tiny_export import build

        model, bird = build(work / "export")
    questions = load_split(bird, "dev")
    results = []
    for replicas in [int(x) for x in a.replicas.split(",")]:
        svc = Service(model, bird, replicas, work / f"serve-{replicas}.log", extra_args=tuple(a.serve_arg))
        try:
            r = asyncio.run(load(svc.url, questions, a.clients, a.seconds, a.hostile_fraction))
        finally:
            r_rc = svc.stop()
        r.update(replicas=replicas, service_rc=r_rc, problems=[])
        r["problems"] = verdict(r)
        results.append(r)
        h = r["healthz"]
        print(f"replicas={replicas}: {r['requests']} requests, {r['rps']} req/s, 5xx {len(r['server_errors'])}, "
              f"client errors {len(r['client_errors'])}, /healthz p50/p90/p99/max {h['p50_ms']}/{h['p90_ms']}/"
              f"{h['p99_ms']}/{h['max_ms']} ms ({h['over_100ms']} of {h['n']} over 100 ms), /-/healthz p50/p99/max "
              f"{h['proxy_p50_ms']}/{h['proxy_p99_ms']}/{h['proxy_max_ms']} ms, load {r['loadavg_min_max']}, "
              f"problems {r['problems'][:3]}", flush=True)
    load_avg = os.getloadavg()
    head = (f"machine: {os.cpu_count()}-core CPU, load average {load_avg[0]:.1f} at the end, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.clients} clients for {a.seconds:g} s each"
            + (f", launch.serve {' '.join(a.serve_arg)}" if a.serve_arg else ""))
    md = head + "\n\n" + markdown(results)
    print(md)
    write_reports(a, {"head": head, "results": results}, md)
    return 0 if all(not r["problems"] and r["service_rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
