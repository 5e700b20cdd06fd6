"""Service throughput and latency of launch.serve on CPU: 1 and C concurrent HTTP clients,
@serve.batch on (max_batch_size B) vs off (max_batch_size=1).

    python -m bench.serve.batching [--model DIR --bird-dir DIR] [--requests 32] [--clients 1,8]

Without --model it builds the tests' tiny export (tests/tiny_export.py: the project's tiny model with a
few seconds of supervised fitting on a synthetic dev split) under /tmp. Every request asks a dev
question with execute=true over a real HTTP connection; one warm-up request per configuration is
not counted. Prints one row per (max_batch_size, clients): requests/s, p50 and p99 latency, mean batch.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(client, questions, requests: int, clients: int) -> dict:
    def ask(i):
        q = questions[i % len(questions)]
        t = time.perf_counter()
        r = client.post("/v1/sql", json={"question": q.question, "db_id": q.db_id, "evidence": q.evidence,
                                         "execute": True})
        r.raise_for_status()
        return time.perf_counter() - t, r.json()["batch_size"]

    ask(0)  # warm-up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(ask, range(requests)))
    wall = time.perf_counter() - start
    lat = [r[0] for r in results]
    return {"rps": requests / wall, "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * percentile(lat, 0.99),
            "mean_batch": statistics.mean(r[1] for r in results)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="")
    p.add_argument("--bird-dir", default="")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", default="1,8")
    p.add_argument("--batch-sizes", default="8,1")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    import httpx
    import ray
    from ray import serve

    from launch.serve_app import ServeOptions, start
    from tasks.bird import load_split

    if args.model:
        model, bird = Path(args.model), Path(args.bird_dir)
    else:
        from tests.tiny_export import build

        model, bird = build(Path(tempfile.mkdtemp(prefix="arl-bench-serve-")))
    questions = load_split(bird, "dev")
    temp_dir = tempfile.mkdtemp(prefix="ray-bench-serve-", dir="/tmp")
    os.environ["PYTHONPATH"] = os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    rows = []
    try:
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            opts = ServeOptions(model=str(model), bird_dir=str(bird), engine="transformers", device="cpu",
                                max_batch_size=b, batch_wait_s=0.01 if b > 1 else 0.0, sql_workers=1)
            url = start(opts, "127.0.0.1", args.port, replicas=1, actor_options={"num_cpus": 1}, timeout_s=600)
            with httpx.Client(base_url=url, timeout=120) as client:
                for c in [int(x) for x in args.clients.split(",")]:
                    m = measure(client, questions, args.requests, c)
                    rows.append((b, c, m))
                    print(f"max_batch_size={b} clients={c}: {m['rps']:.1f} req/s, p50 {m['p50_ms']:.0f} ms, "
                          f"p99 {m['p99_ms']:.0f} ms, mean batch {m['mean_batch']:.1f}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print("\n| max_batch_size | clients | req/s | p50 ms | p99 ms | mean batch |\n|---|---|---|---|---|---|")
    for b, c, m in rows:
        print(f"| {b} | {c} | {m['rps']:.1f} | {m['p50_ms']:.0f} | {m['p99_ms']:.0f} | {m['mean_batch']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
