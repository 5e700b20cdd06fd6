"""Wall time of `python -m launch.cluster RECIPE --preflight --simulate`, end to end and by phase.

    .venv/bin/python -m bench.cpu.preflight [--recipe bird_32b] [--repeats 1]

Runs the CLI command itself in a subprocess (cluster start, placement groups, probes, all-reduce,
weight-sync bucket, teardown) and reads the phase timings it prints. Prints a Markdown table row per
run plus the machine (CPU count, load average before the run) and the UTC date.
"""
from __future__ import annotations

import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

REPO = sys.path[0]


def run_once(recipe: str, timeout_s: float) -> tuple[float, dict[str, float], str]:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "launch.cluster", recipe, "--preflight", "--simulate"], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{recipe} --preflight --simulate failed (rc {r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("timings: ")), "")
    phases = {k.strip(): float(v) for k, v in re.findall(r"([a-z -]+?) ([0-9.]+) s", line.removeprefix("timings: "))}
    actors = next((ln for ln in r.stdout.splitlines() if ln.startswith("preflight: ")), "")
    return wall, phases, actors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bird_32b")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args()
    print(f"{args.recipe} --preflight --simulate; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| run | load avg before | wall s | placement groups s | probes placed s | all-reduce s | weight sync s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i in range(args.repeats):
        load = os.getloadavg()[0]
        wall, ph, actors = run_once(args.recipe, args.timeout_s)
        print(f"| {i + 1} | {load:.1f} | {wall:.1f} | {ph.get('placement groups', 0):.1f} | "
              f"{ph.get('probes placed', 0):.1f} | {ph.get('all-reduce', 0):.1f} | {ph.get('weight sync', 0):.1f} |",
              flush=True)
    print(actors)


if __name__ == "__main__":
    main()
