"""One run, start to finish: data, model, Redis, Ray, the actors, the coordinator's loop.

The whole control loop lives in actors/coordinator/coordinator.py; this module only prepares inputs
(launch/inputs.py: built in a child process that exits, so this process never imports torch), places the
actors and tears everything down (Ctrl-C and errors included), so that nothing it started (Ray workers,
redis-server) outlives it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from config import ConfigError, RunConfig, RunContext, check_inputs
from config import layout
from queues.errors import one_line  # noqa: F401 - launch.run.one_line for the CLI and preflight
from tasks.bird import BirdDataError
from launch.commands import command
from launch.inputs import build_in_child, input_paths, offline_unless_allowed
from launch.inputs import load_prompts, prepare_model_and_data  # noqa: F401 - launch.run's names (bench/)
from launch.export import next_steps
from launch.progress import summary
from observe.logs import setup_logging

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


def resolve_run_dir(cfg: RunConfig) -> tuple[str, Path]:
    root = Path(cfg.run_root).absolute()
    run_id = cfg.run_id
    if cfg.coordinator.resume and not run_id:
        runs = sorted((p for p in root.glob(f"{cfg.name}-*") if layout.latest_marker(p).exists()),
                      key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(f"config key 'coordinator.resume': no checkpointed run named {cfg.name}-* under {root}")
        run_id = runs[-1].name
    if not run_id:
        run_id = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000:04d}"
    return run_id, root / run_id


def check_bird_dir(cfg: RunConfig) -> None:
    """A broken BIRD directory is a one-line ConfigError before the run directory exists and before
    minutes of model building."""
    if cfg.data.synthetic:
        return
    from tasks.bird import load_split

    for split in (cfg.data.train_split, cfg.data.eval_split):
        try:
            load_split(cfg.data.bird_dir, split)
        except BirdDataError as e:
            raise ConfigError(f"config key 'data.bird_dir': {e}") from None


def launcher_footprint() -> dict[str, Any]:
    """This process's peak RSS (MB) and whether torch / transformers were ever imported in it (1/0): the
    launcher lives as long as the run and should stay light (launch/inputs.py)."""
    import resource
    import sys

    return {"launcher_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "launcher_torch": int("torch" in sys.modules), "launcher_transformers": int("transformers" in sys.modules)}


class RunFailed(ConfigError):
    """A user-facing failure of a run: one line for the console (cluster.py prints `error: ...`),
    the full traceback in <run_dir>/logs/launcher.jsonl."""


def _log_failure(run_dir: Path, e: BaseException) -> None:
    import json
    import traceback

    try:
        with open(layout.log_file(run_dir, "launcher"), "a") as f:
            from queues.streams import redact

            f.write(json.dumps({"event": "run failed", "level": "error", "error": one_line(e),
                                "traceback": redact("".join(traceback.format_exception(e))),
                                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    except OSError:
        pass


def redis_url_of(cfg: RunConfig) -> str:
    return cfg.cluster.redis_url or os.environ.get("REDIS_URL", "")


def ray_address_of(cfg: RunConfig) -> str:
    return cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS", "")


def preflight(cfg: RunConfig) -> None:
    """Checks that take a second, before minutes of model building: the external Redis answers
    (and takes our password), the Ray address answers."""
    import asyncio
    import socket

    url = redis_url_of(cfg)
    if url:
        from queues.streams import RedisUnavailable, ping, redact

        try:
            asyncio.run(ping(url, timeout_s=5.0))
        except RedisUnavailable as e:
            raise RunFailed(f"REDIS_URL: {e}") from None
        except Exception as e:  # noqa: BLE001 - e.g. a malformed URL
            raise RunFailed(f"REDIS_URL {redact(url)!r}: {one_line(e)}") from None
    address = ray_address_of(cfg)
    if address and address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3.0):
                pass
        except (OSError, ValueError) as e:
            raise RunFailed(f"RAY_ADDRESS {address!r}: no Ray cluster answers there ({e})") from None


def purge_run_keys(url: str, run_id: str) -> int:
    """Deletes a run's streams and assembler memo (a resumed run restarts from its checkpoint;
    what a persisted or external Redis still holds of the crashed attempt must not leak in)."""
    import asyncio

    from queues.streams import purge_run

    return asyncio.run(purge_run(url, run_id))


def start_redis(cfg: RunConfig, run_dir: Path, log):
    """(url, embedded server or None): REDIS_URL / cluster.redis_url, else an embedded server."""
    url = redis_url_of(cfg)
    if url:
        return url, None
    from queues.redis_server import EmbeddedRedis

    server = EmbeddedRedis(run_dir, persistence=cfg.cluster.redis_persistence).start()
    # With AOF, a redis-server that dies on its own is restarted on the same socket; clients
    # reconnect (queues.streams retries) and find every stream, group and pending entry.
    server.supervise(lambda down_s, err: log.warning("embedded redis-server died; restarted" if not err else
                                                     "embedded redis-server restart failed",
                                                     seconds=round(down_s, 3), error=err))
    return server.url, server


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
    runtime-env agent (setup_worker.py) before it starts, ~13 s to the five actors on the loaded 2 cores
    (docs/perf/peers.md), for variables a local raylet's workers inherit anyway. The dashboard of a local
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
                           _temp_dir=os.environ.get("ARL_RAY_TMP") or None)


def run(cfg: RunConfig) -> int:
    check_inputs(cfg)
    check_bird_dir(cfg)
    preflight(cfg)
    run_id, run_dir = resolve_run_dir(cfg)
    fresh = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_id = run_id
    log = setup_logging(run_dir, "launcher", level=cfg.logging.level, console=cfg.logging.console)
    from queues.streams import redact

    layout.config_file(run_dir).write_text(redact(msgspec.json.format(msgspec.json.encode(cfg), indent=2).decode()))
    redis_server = None
    interrupted = {"flag": False}

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    pending = None
    try:
        # The model, data, prompts and warm-start draws are built in a child process (launch/inputs.py) while
        # Redis starts; Ray starts once they are ready, so that bad input still fails in seconds.
        offline_unless_allowed(cfg)
        pending = build_in_child(cfg, run_dir)
        model_path, bird_dir = input_paths(cfg, run_dir)
        redis_url, redis_server = start_redis(cfg, run_dir, log)
        # What every actor is built from beside its config section (launch/place.py); the scorers open
        # databases under data_dir only.
        ctx = RunContext.of(cfg, run_id, run_dir, redis_url, data_dir=Path(bird_dir).resolve())
        if cfg.coordinator.resume:
            purged = purge_run_keys(redis_url, run_id)
            if purged:
                log.info("resume: dropped the crashed attempt's streams", keys=purged)
        inputs = pending.result()
        model_path, train_items, eval_items = inputs.model_path, inputs.train_items, inputs.eval_items
        start_ray(cfg, run_dir, log)
        # Again: ray.init installs its own SIGTERM handler (the driver aborts with a C++ stack, skipping
        # this teardown); ours makes SIGTERM the Ctrl-C path (bench/soak.py stops every half with it).
        signal.signal(signal.SIGTERM, on_sigterm)
        import ray

        log.info("run started", run_id=run_id, run_dir=str(run_dir), redis=redis_server.socket_path if redis_server else
                 "external", dashboard=_dashboard_url())
        result = run_with_relaunches(cfg, ctx, model_path, train_items, eval_items, log, draws=inputs.draws)
        log.info("run finished", **{k: v for k, v in result.items() if k != "outcomes"}, **{
            f"prompts_{k}": v for k, v in result["outcomes"].items()}, **launcher_footprint())
        print(summary(run_dir), flush=True)
        print(f"run directory: {run_dir}\nmetrics: {layout.metrics_file(run_dir)}\n"
              f"plot: {command('launch.report', run_dir)}" + next_steps(run_dir, bird_dir, cfg.data.eval_split),
              flush=True)
        return 0
    except KeyboardInterrupt:
        interrupted["flag"] = True
        log.warning("interrupted: shutting down")
        return 130
    except (ConfigError, BirdDataError) as e:
        if fresh and not layout.metrics_file(run_dir).exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # bad input: leave no empty run directory behind
        else:
            _log_failure(run_dir, e)
        if isinstance(e, BirdDataError):
            raise ConfigError(f"config key 'data.bird_dir': {e}") from None
        raise
    except Exception as e:  # noqa: BLE001 - one line for the user, the traceback in the log
        _log_failure(run_dir, e)
        raise RunFailed(f"{one_line(e)} (traceback: {run_dir / 'logs' / 'launcher.jsonl'})") from None
    finally:
        if pending is not None:
            pending.close()
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # noqa: BLE001 - teardown must reach redis
            pass
        if redis_server is not None:
            redis_server.stop()


def actor_died(e: BaseException) -> bool:
    """Whether `e` is, or was caused by, the death of a Ray actor (Ray wraps the cause), a call to an
    actor that ran past its bound (ActorCallTimeout: a frozen actor, handled as a dead one), or a
    collective that failed on a dead or hung peer within learner.collective_timeout_s: that world
    cannot go on."""
    from ray.exceptions import RayActorError

    from actors.learner.world import is_collective_failure
    from actors.shell import ActorCallTimeout

    for _ in range(8):
        if isinstance(e, (RayActorError, ActorCallTimeout)) or is_collective_failure(e):
            return True
        nxt = getattr(e, "cause", None) or e.__cause__
        if nxt is None or nxt is e:
            return False
        e = nxt
    return False


def run_with_relaunches(cfg: RunConfig, ctx: RunContext, model_path: str, train_items: list, eval_items: list,
                        log, draws=None) -> dict[str, Any]:
    """place_and_run, started again from the latest checkpoint when the learner or the
    coordinator dies (actors Ray does not restart), any actor freezes (a call to it ran past
    coordinator.call_timeout_s; the relaunch kills it) or a learner collective fails on a dead or hung
    peer (learner.collective_timeout_s), up to cluster.max_relaunches times. Before the run's first
    checkpoint it starts again from the beginning (warm start included): nothing of the attempt counts,
    its metrics rows are superseded by the new attempt's. `draws`: the warm start's (launch/inputs.py), kept
    for such a start again."""
    from actors.coordinator.coordinator import Coordinator
    from launch.place import kill_run_actors, place_and_run

    run_id = ctx.run_id
    relaunches = 0
    while True:
        try:
            names = run_id if relaunches == 0 else f"{run_id}:relaunch{relaunches}"
            return place_and_run(cfg, ctx, model_path, train_items, eval_items, log, names, draws=draws)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is an actor death we can resume from
            latest = Coordinator.latest_checkpoint(Path(ctx.run_dir))
            if not actor_died(e) or relaunches >= cfg.cluster.max_relaunches:
                raise
            relaunches += 1
            origin = latest.name if latest is not None else "the start (no checkpoint yet)"
            log.warning("an actor died or froze, or a collective failed: relaunching the run from its latest checkpoint",
                        error=one_line(e), checkpoint=origin, relaunch=relaunches, of=cfg.cluster.max_relaunches)
            print(f"relaunching from {origin} ({relaunches}/{cfg.cluster.max_relaunches}): {one_line(e)}",
                  flush=True)
            kill_run_actors(run_id)
            purge_run_keys(ctx.redis_url, run_id)
            cfg.coordinator.resume = latest is not None


def _dashboard_url() -> str:
    try:
        import ray

        url = getattr(ray, "_private").worker.get_dashboard_url() if hasattr(ray, "_private") else ""
        return f"http://{url}" if url and not url.startswith("http") else (url or "n/a")
    except Exception:  # noqa: BLE001
        return "n/a"
