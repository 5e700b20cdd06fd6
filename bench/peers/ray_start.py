"""What a local Ray costs tiny before its first step, with and without the dashboard and the runtime_env.

    nice -n 10 .venv/bin/python -m bench.peers.ray_start [REPS]      # default 2 rounds of the 4 variants

Each variant is a fresh process (run by bench/peers/tree.py, its process tree's RSS sampled): ray.init of a
local 2-CPU cluster as launch/run.py starts one (dashboard on or off; runtime_env={"env_vars": ...} as
run_env() gives, or none), then five trivial actors (tiny's coordinator, generator, scorer, assembler,
learner) each answering one call. Prints, per variant, the median seconds to ray.init returned, to the
first actor's answer, to all five, the whole process, and the peak RSS of the tree. Variants alternate
within a round, so a machine's load drifts across all of them alike.

Invariants: nothing of the project's actors is imported (the numbers are Ray's own); every process the
variant started is gone when it returns (ray.shutdown, then the tree is killed).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.peers.tree import run_tree

VARIANTS = [("dashboard + runtime_env env_vars", True, True),
            ("no dashboard", False, True),
            ("no runtime_env (the env inherited)", True, False),
            ("neither (as tiny starts it)", False, False)]

CHILD = r"""
import json, os, sys, time
t0 = time.time()
import ray
dashboard, runtime_env, tmp = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3]
env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.getcwd()}}
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
t_import = time.time()
ray.init(address="local", num_cpus=2, include_dashboard=dashboard, runtime_env=env if runtime_env else None,
         log_to_driver=False, _temp_dir=tmp)
t_init = time.time()

@ray.remote(num_cpus=0.25)
class A:
    def ping(self):
        return os.getpid()

actors = [A.remote() for _ in range(5)]
first = ray.get(actors[0].ping.remote())
t_first = time.time()
ray.get([a.ping.remote() for a in actors])
t_all = time.time()
ray.shutdown()
print(json.dumps({"import_s": t_import - t0, "init_s": t_init - t0, "first_actor_s": t_first - t0,
                  "five_actors_s": t_all - t0, "shutdown_s": time.time() - t_all}))
"""


def one(dashboard: bool, runtime_env: bool, out: Path) -> dict:
    tmp = tempfile.mkdtemp(prefix="arl-rs-", dir="/tmp")
    log = out / f"rs-{int(dashboard)}{int(runtime_env)}-{len(list(out.iterdir()))}.log"
    t = run_tree([sys.executable, "-c", CHILD, str(int(dashboard)), str(int(runtime_env)), tmp], log_path=log,
                 timeout_s=600)
    lines = [x for x in log.read_text().splitlines() if x.startswith("{")]
    if t.rc != 0 or not lines:
        raise SystemExit(f"error: ray start variant dashboard={dashboard} runtime_env={runtime_env} failed: see {log}")
    return {**json.loads(lines[-1]), "wall_s": t.wall_s, "peak_rss_gb": t.peak_rss_bytes / 1e9,
            "peak_processes": t.peak_processes}


def main(argv: list[str]) -> int:
    reps = int(argv[0]) if argv else 2
    out = Path(tempfile.mkdtemp(prefix="arl-ray-start-"))
    got: dict[str, list[dict]] = {name: [] for name, _, _ in VARIANTS}
    for r in range(reps):
        for name, dash, renv in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            got[name].append(one(dash, renv, out))
            print(f"round {r}: {name}: {json.dumps({k: round(v, 2) for k, v in got[name][-1].items()})}",
                  file=sys.stderr, flush=True)
    keys = ["init_s", "first_actor_s", "five_actors_s", "wall_s", "peak_rss_gb"]
    print("| variant | ray.init returned, s | first actor answered, s | five actors, s | whole process, s | "
          "peak RSS, GB | processes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in got.items():
        med = {k: statistics.median(x[k] for x in rows) for k in keys}
        procs = max(x["peak_processes"] for x in rows)
        print(f"| {name} | {med['init_s']:.1f} | {med['first_actor_s']:.1f} | {med['five_actors_s']:.1f} | "
              f"{med['wall_s']:.1f} | {med['peak_rss_gb']:.2f} | {procs} |")
    (out / "ray_start.json").write_text(json.dumps(got, indent=1))
    print(f"\nraw: {out / 'ray_start.json'} ({reps} rounds, medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
