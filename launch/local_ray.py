"""Ray for a run: a local cluster of our own (its settings, loopback binding, retries of Ray's fixed start-up
wait) or a joined one, and the environment every actor gets (run_env).

Invariants:
- A local cluster is always new (ray.init(address="local")), never one found through /tmp/ray; its processes
  inherit run_env() and LOCAL_RAY_ENV from this process's environment while ray.init runs, restored after.
- A joined cluster (cluster.ray_address / $RAY_ADDRESS) gets run_env() as the job's runtime_env.
- A local start whose raylet missed Ray's 30 s registration wait leaves nothing behind before it is tried
  again (end_new_children), LOCAL_RAY_ATTEMPTS times in all; any other error is raised at once.
- Under cluster.ray_loopback every socket of the local cluster binds 127.0.0.1 (ray_on_loopback).
- `end_ray` ends a local cluster of ours in one bounded wait (the raylet first, the rest at once), not
  Ray's one-by-one graceful stops (~1.5 s); a joined cluster is only disconnected from, as ray.shutdown does.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from config import RunConfig

# Variables every actor gets, whether we started Ray or joined a cluster.
FORWARDED_PREFIXES = ("WANDB_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "ARL_", "VLLM_", "NCCL_", "TORCH_",
                      "CUDA_", "PYTORCH_", "OMP_", "TOKENIZERS_")


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    return env


# Ray's switch for a local-only node (its default on macOS and Windows): the node's address is 127.0.0.1.
RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def ray_on_loopback(enabled: bool):
    """While a local cluster starts, its node address is loopback, and so is every socket it opens.

    Ray binds by node address: its C++ gRPC servers (GCS, raylet, core workers) listen on 127.0.0.1
    only when that address is localhost, else on [::]; agents and metrics endpoints follow suit.
    ray.init(_node_ip_address="127.0.0.1") is rewritten to the host's address
    (ray/_private/services.py resolve_ip_for_localhost); RAY_LOCAL_ONLY=0 makes
    services.get_node_ip_address() answer 127.0.0.1. Ray reads it at import
    (ray_constants.ENABLE_RAY_CLUSTER), so both are set; what ray.init starts inherits it. Both are
    restored after: a later ray.init(address=...) here must find its node by the host's address."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    saved = os.environ.get(RAY_LOCAL_ONLY), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[RAY_LOCAL_ONLY], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(RAY_LOCAL_ONLY, None)
        else:
            os.environ[RAY_LOCAL_ONLY] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


DASHBOARD_MODULES = ("aiohttp", "aiohttp_cors", "opencensus", "prometheus_client")


def dashboard_available(log=None) -> bool:
    """Whether Ray's dashboard can start here (ray[default]'s modules); a bare `ray` wheel (seen on the
    H200 image: no aiohttp_cors) makes ray.init fail with include_dashboard=True, so the run goes on
    without it and says so."""
    import importlib.util

    missing = [m for m in DASHBOARD_MODULES if importlib.util.find_spec(m) is None]
    if missing and log is not None:
        log.warning("ray dashboard off: its modules are not installed", missing=",".join(missing),
                    fix='pip install "ray[default]"')
    return not missing


# Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py); on a loaded machine (seen at
# load average ~35 on 2 cores) that wait runs out and ray.init raises. A local start is tried this often.
# Ray's raylet must register within a fixed 30 s (ray/_private/node.py, no setting); a start on a machine at
# load ~40 missed it three times in a row (2026-12-04 22:33-22:35 UTC, the README's tiny on the shared 2 cores).
LOCAL_RAY_ATTEMPTS = 5


# Ray settings of a cluster we start, unless the user's environment sets them. The GCS keeps the events of
# the last 100,000 tasks by default, ~3.4 kB each (measured: +68 MB per 20,000 actor calls, flat past the
# cap): a run's actor calls (~12/s in tiny, every step's handshake and health checks) grew it without end
# for hours (issue 27's soak: gcs_server +41 % in 30 minutes). 2,000 keeps `ray list tasks` and the
# dashboard's task view for the last minutes of a run, ~7 MB.
# RAY_worker_niceness: Ray starts its workers (every actor of ours) 15 nice levels below the raylet otherwise,
# so on a shared machine the whole run yielded to any other work (checked: launcher nice 5 -> actor nice 19;
# with 0 the actors run at the launcher's priority).
LOCAL_RAY_ENV = {"RAY_task_events_max_num_task_in_gcs": "2000", "RAY_worker_niceness": "0"}


def init_local_ray(log=None, **kwargs) -> None:
    """ray.init(address="local", **kwargs): always a new cluster of our own, never one found through
    /tmp/ray/ray_current_cluster (another user's or another run's; RAY_ADDRESS joins one), its processes
    started with LOCAL_RAY_ENV where the environment does not set those variables. Started again
    (after a shutdown) when Ray's fixed 30 s raylet wait ran out, LOCAL_RAY_ATTEMPTS times in all; any
    other error is raised at once. Used by the launcher, launch.serve and the tests' local clusters."""
    import ray

    for attempt in range(1, LOCAL_RAY_ATTEMPTS + 1):
        before = child_pids()
        try:
            with environ({k: os.environ.get(k, v) for k, v in LOCAL_RAY_ENV.items()}):
                ray.init(address="local", **kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray's fixed 30 s raylet registration wait
            if "timed out during startup" not in str(e) or attempt == LOCAL_RAY_ATTEMPTS:
                raise
            if log is not None:
                log.warning("local ray did not start in its 30 s (an overloaded machine?); starting it again",
                            attempt=attempt, of=LOCAL_RAY_ATTEMPTS)
            ray.shutdown()
            end_new_children(before)


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """os.environ with `values` set, restored after: a local cluster's processes (GCS, raylet, and the
    workers the raylet starts) inherit the environment ray.init was called in."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def child_pids() -> set[int]:
    """Every live descendant of this process."""
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def end_new_children(before: set[int]) -> int:
    """Kills the descendants started since `before` was taken, but a redis-server (the embedded one's
    supervisor may have restarted it meanwhile). A ray.init that timed out leaves the processes it
    started (GCS, dashboard, monitors) running, and ray.shutdown() does not know them: without this
    they would live as long as the launcher, beside the cluster of the next attempt."""
    import psutil

    ended = 0
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid not in before and c.name() != "redis-server":
                c.kill()
                ended += 1
        except psutil.Error:
            pass
    return ended


def start_ray(cfg: RunConfig, run_dir: Path, log) -> None:
    """A cluster joined (cluster.ray_address / $RAY_ADDRESS) gets run_env() as the job's runtime_env; a
    local cluster inherits it from this process instead: a runtime_env sends every worker through Ray's
    runtime-env agent (setup_worker.py) before it starts, +2.5 s to five trivial actors on the 2 cores
    (bench.peers.ray_start, docs/perf/peers.md "Start-up"), for variables a local raylet's workers inherit anyway. The dashboard of a local
    cluster is cluster.dashboard (and off when ray[default]'s modules are missing); its settings (LOCAL_RAY_ENV:
    the actors at the launcher's own priority, a capped GCS task history) are init_local_ray's."""
    import ray
    from ray._private.utils import get_num_cpus as host_cpus

    from config.placement import local_num_cpus, make_placement

    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, runtime_env={"env_vars": run_env()}, log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        with ray_on_loopback(cfg.cluster.ray_loopback), environ(run_env()):
            init_local_ray(log, num_cpus=cfg.cluster.num_cpus or local_num_cpus(make_placement(cfg), host_cpus()),
                           num_gpus=cfg.cluster.gpus_per_node or None,
                           include_dashboard=cfg.cluster.dashboard and dashboard_available(log),
                           dashboard_host=cfg.cluster.dashboard_host, log_to_driver=False,
                           _temp_dir=os.environ.get("ARL_RAY_TMP") or None,
                           # Ray's "Started a local Ray instance" line would come before a bad input's one-line
                           # error (Ray starts while the inputs are built); the launcher's own `run started`
                           # line names the dashboard.
                           logging_level=logging.WARNING)


# Ray's ray.shutdown() stops a local cluster's processes one by one, each given up to 1 s to exit after
# SIGTERM (ray/_private/node.py kill_all_processes): 1.5-1.6 s measured on the 2 cores, most of it the
# autoscaler monitor's sleep. `end_ray` asks the raylet first (it ends its workers) and then every other
# process at once, the bookkeeping ones (no state a finished run needs) killed outright.
RAYLET_EXIT_S = 1.0  # the raylet's graceful exit (0.07 s measured); SIGKILL after
REST_EXIT_S = 1.0  # the others together (the GCS: 0.1-0.3 s); SIGKILL after
KILL_REAP_S = 0.5  # a SIGKILLed process's exit, waited for at most this
KILLED_OUTRIGHT = ("monitor", "log_monitor", "dashboard", "dashboard_agent", "runtime_env_agent")


def _end_processes(processes: list[tuple[str, Any]]) -> None:
    import subprocess

    def end(group: list, graceful_s: float) -> None:
        for kind, p in group:
            if p.poll() is None:
                (p.kill if kind in KILLED_OUTRIGHT else p.terminate)()
        deadline = time.monotonic() + graceful_s
        for _, p in group:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for _, p in group:  # reaped (a SIGKILLed process exits at once; bounded all the same)
            try:
                p.wait(timeout=max(0.1, deadline + KILL_REAP_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    end([x for x in processes if x[0] == "raylet"], RAYLET_EXIT_S)
    end([x for x in processes if x[0] != "raylet"], REST_EXIT_S)


def end_ray() -> None:
    """ray.shutdown(), with the processes of a local cluster this process started ended at once (bounded:
    RAYLET_EXIT_S + REST_EXIT_S, then SIGKILL). A joined cluster (no node of ours) is disconnected from."""
    import ray
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is not None and hasattr(node, "all_processes"):
        processes = [(kind, info.process) for kind, infos in node.all_processes.items() for info in infos]
        node.kill_all_processes = lambda **_: _end_processes(processes)  # this node only; gone after shutdown
    ray.shutdown()
