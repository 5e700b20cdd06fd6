"""One run, start to finish: data, model, Redis, Ray, the actors, the coordinator's loop.

The whole control loop lives in actors/coordinator/coordinator.py; this module only prepares inputs
(launch/inputs.py: built in a child process that exits, so this process never imports torch), places the
actors and tears everything down (Ctrl-C and errors included), so that nothing it started (Ray workers,
redis-server) outlives it.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from config import ConfigError, RunConfig, RunContext, check_inputs, layout
from launch.commands import command
from launch.export import next_steps
from launch.inputs import build_in_child, input_paths, load_prompts, offline_unless_allowed, prepare_model_and_data  # noqa: F401 - launch.run's names (bench/)
from launch.local_ray import end_ray, start_ray
from launch.progress import summary
from observe.logs import setup_logging
from queues.errors import one_line  # noqa: F401 - launch.run.one_line for the CLI and preflight
from tasks.bird import BirdDataError


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
            from queues.errors import redact

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


def run(cfg: RunConfig) -> int:
    check_inputs(cfg)
    check_bird_dir(cfg)
    preflight(cfg)
    run_id, run_dir = resolve_run_dir(cfg)
    fresh = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_id = run_id
    log = setup_logging(run_dir, "launcher", level=cfg.logging.level, console=cfg.logging.console)
    from queues.errors import redact  # not queues.streams': redis' client (0.14 s) need not load before Ray starts

    layout.config_file(run_dir).write_text(redact(msgspec.json.format(msgspec.json.encode(cfg), indent=2).decode()))
    redis_server = None
    interrupted = {"flag": False}

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    pending = None
    try:
        # The model, data, prompts and warm-start draws are built in a child process (launch/inputs.py) while
        # Redis and Ray start: both wait on processes of their own, so the two overlap even on 2 cores
        # (docs/perf/peers.md). Bad input still fails in seconds: the child's error is raised as
        # soon as Ray is up, and the teardown below stops Ray and Redis.
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
        start_ray(cfg, run_dir, log)
        # Again: ray.init installs its own SIGTERM handler (the driver aborts with a C++ stack, skipping
        # this teardown); ours makes SIGTERM the Ctrl-C path (bench/faults/soak.py stops every half with it).
        signal.signal(signal.SIGTERM, on_sigterm)
        inputs = pending.result()
        model_path, train_items, eval_items = inputs.model_path, inputs.train_items, inputs.eval_items
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
                end_ray()  # a local cluster's processes ended at once (launch/local_ray.py), not one by one
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
    from actors.coordinator.checkpoint import Checkpoints
    from launch.place import kill_run_actors, place_and_run

    run_id = ctx.run_id
    relaunches = 0
    while True:
        try:
            names = run_id if relaunches == 0 else f"{run_id}:relaunch{relaunches}"
            return place_and_run(cfg, ctx, model_path, train_items, eval_items, log, names, draws=draws)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is an actor death we can resume from
            latest = Checkpoints.latest(Path(ctx.run_dir))
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
