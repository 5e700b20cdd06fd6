"""What a route that crosses a Ray Serve replica costs under load, against one the proxy answers itself.

    .venv/bin/python -m bench.serve.hop --poll-s 1 --seconds 120     # ~4 min on the loaded 2-core machine

launch.serve (tiny export, its own local Ray, port 8123) plus a no-op app at /echo (one replica, no CPU
reserved, answers "ok" with no work), 64 closed-loop clients (6 hostile, as bench.serve.load's), and a
probe process that GETs, every 0.25 s, /healthz (launch/serve_health.py), /echo, and the proxy's own
/-/healthz. `--poll-s` is the health app's controller poll (a large value: one poll at start only), to
tell its cost from the replica hop's. Prints n / p50 / p90 / p99 / max ms and answers over 100 ms per path.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

PATHS = ("/healthz", "/echo", "/-/healthz")


def _probe(url: str, stop_at: float, out) -> None:
    import httpx

    lat: dict[str, list[float]] = {p: [] for p in PATHS}
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.monotonic() < stop_at:
            for p in PATHS:
                t = time.perf_counter()
                http.get(p)
                lat[p].append(time.perf_counter() - t)
            time.sleep(0.25)
    out.put(lat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=120.0)
    a = p.parse_args(argv)
    import httpx
    import ray
    from ray import serve
    from starlette.responses import PlainTextResponse

    from bench.serve.batching import percentile
    from bench.serve.load import Tally, _client, hostile_requests, ordinary_requests
    from launch.local_ray import init_local_ray
    from launch.serve_app import ServeOptions, start
    from tasks.bird import load_split
    from tests.tiny_export import build

    work, ray_dir = tempfile.mkdtemp(prefix="arl-serve-hop-"), tempfile.mkdtemp(prefix="ray-serve-hop-")
    model, bird = build(Path(work))
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    init_local_ray(num_cpus=2, include_dashboard=False, _temp_dir=ray_dir, log_to_driver=False)
    try:
        opts = ServeOptions(model=str(model), bird_dir=str(bird), engine="transformers", device="cpu",
                            health_poll_s=a.poll_s, health_max_age_s=max(15.0, 10 * a.poll_s))
        url = start(opts, "127.0.0.1", 8123, replicas=1, actor_options={"num_cpus": 1}, timeout_s=600)

        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Echo:
            async def __call__(self, request):
                return PlainTextResponse("ok")

        serve.run(Echo.bind(), name="echo", route_prefix="/echo")
        questions = load_split(bird, "dev")
        stop_at = time.monotonic() + a.seconds
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        prober = ctx.Process(target=_probe, args=(url, stop_at, out), daemon=True)
        prober.start()

        async def load():
            tally, hostile, ordinary = Tally(), hostile_requests(questions[0].db_id), ordinary_requests(questions)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=72)) as http:
                await asyncio.gather(*(_client(http, hostile if c < 6 else ordinary, c < 6, stop_at, tally, 7 * c)
                                       for c in range(64)))

        asyncio.run(load())
        lat = out.get(timeout=300)
        for path in PATHS:
            xs = lat[path]
            print(f"poll_s={a.poll_s:g} {path}: n={len(xs)} p50={1000 * percentile(xs, .5):.0f} "
                  f"p90={1000 * percentile(xs, .9):.0f} p99={1000 * percentile(xs, .99):.0f} "
                  f"max={1000 * max(xs):.0f} over_100ms={sum(x > 0.1 for x in xs)}", flush=True)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        serve.shutdown()
        ray.shutdown()
        for d in (work, ray_dir):  # the export and Ray's temp dir go with the run
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
