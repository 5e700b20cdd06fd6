"""launch.serve's command line and life cycle: who may get in and a port checked before anything starts,
our own Ray on loopback, SIGTERM as Ctrl-C, and a stop that leaves no Ray process, agent, socket or
temp dir behind.

Invariants:
- `main` checks the host against the API key first (launch/serve_http.py host_refusal: an address
  other than loopback without a key is one line, exit 2, before any other check or start), then the
  arguments, the export, the databases and the port (one line, exit 2 each), and only then starts Ray.
  The key itself never leaves this process: the replicas get its SHA-256.
- `check_port` binds the proxy's address once, before Ray starts: a taken port or an address this
  host does not have is one ValueError line (the CLI's exit 2), not Ray Serve's tracebacks.
- After `interrupt_on_sigterm`, SIGTERM raises KeyboardInterrupt in the main thread, so the CLI's
  `finally` runs for it exactly as for Ctrl-C (ray.init replaces the handler with one that exits 15:
  the CLI installs it again after; during ray.init that exit still runs the same `finally`). The first
  Ctrl-C or SIGTERM sets both to ignored as it raises, so a second one on its heels (seen: a signal sent
  to the CLI and to a wrapper that passed it on) cannot raise again on the way into `stop`.
- In a replica of our own (loopback) cluster, Serve's inter-deployment gRPC server binds 127.0.0.1
  (`replica_grpc_on_loopback`): with --host beyond loopback, the proxy is the one socket exposed.
- A cluster of our own is started with `cluster_env` (launch/serve_health.py's `proxy_env`) in the
  environment, so its Ray Serve proxy answers /healthz itself (no hop to a replica); a joined cluster
  (--ray-address) gets the health app instead (launch/serve_app.py start).
- A model replica runs `--replica-nice` (default 10) nice levels below the rest of the service
  (`lower_priority`, from its constructor: every thread of it, and so its generation threads and its
  sandbox worker processes): on a host with no spare core, Ray Serve's proxy, its controller and the
  /healthz replica preempt generation and runaway SQL instead of queueing behind them.
- `stop` ignores further Ctrl-C/SIGTERM while it runs (a second Ctrl-C cannot cut the clean-up short),
  shuts Serve down only when Ray is up (serve.shutdown() on no Ray would start a new local one), shuts
  Ray down, waits a bounded time for every process this one started to exit, kills the rest by pid,
  and removes Ray's temp dir.
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path


def check_port(host: str, port: int) -> None:
    """ValueError (one line) when the proxy could not listen on host:port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"{host}:{port} {why}: pick another --port (or --host)") from None


def replica_grpc_on_loopback() -> bool:
    """In a replica of a cluster whose node address is loopback (ours: launch.local_ray.ray_on_loopback), makes
    Ray Serve's inter-deployment gRPC server bind 127.0.0.1 instead of every interface: Ray 2.60's replica
    hard-codes `[::]:0` (ray/serve/_private/replica.py `_on_initialized`), the one socket of the service
    beyond loopback besides the proxy. Called from the replica's constructor, which runs before that
    server starts. True when it applied; a Ray without that hook is left as it is (tests/e2e/test_serve_life
    fails on any such socket)."""
    import ray

    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    if ray.util.get_node_ip_address() not in ("127.0.0.1", "::1") or not hasattr(replica, "add_port_to_grpc_server"):
        return False
    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "_arl_loopback", False):
        return True

    def on_loopback(server, address):
        return add_port(server, "127.0.0.1:0" if address == "[::]:0" else address)

    on_loopback._arl_loopback = True
    replica.add_port_to_grpc_server = on_loopback
    return True


def lower_priority(steps: int) -> int:
    """Every thread of this process `steps` nice levels lower in priority (at most 19), so every thread
    and child process started from it later too (on Linux nice is per thread and a new thread or process
    inherits its creator's); returns the calling thread's nice after. A CPU-bound replica niced so yields
    the CPU to the service's light processes at once (they stay at the launcher's level), and still gets
    all of it when they sleep. Only ever lowers (raising needs privileges)."""
    if steps <= 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    done: set[int] = set()
    while True:  # again while threads appear meanwhile (one created by a thread not yet lowered)
        try:
            tids = {int(t) for t in os.listdir("/proc/self/task")}
        except OSError:  # no /proc (macOS): there the nice value is the process's
            tids = {0}
        if tids <= done:
            return os.getpriority(os.PRIO_PROCESS, 0)
        for tid in tids - done:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
            except OSError:  # a thread that ended meanwhile
                pass
        done |= tids


def _interrupt_once(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `stop` puts both back when it ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_sigterm() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt once; after it both are ignored until `stop` ends."""
    signal.signal(signal.SIGTERM, _interrupt_once)
    signal.signal(signal.SIGINT, _interrupt_once)


def stop(temp_dir: str | None, wait_s: float = 15.0) -> list[int]:
    """Serve and Ray down, every child process gone (waited for up to `wait_s`, then killed), the temp
    dir removed; returns the pids that had to be killed."""
    import psutil
    import ray

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    children = psutil.Process().children(recursive=True)
    try:
        if ray.is_initialized():
            from ray import serve

            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001  (Ray going down under us: the shutdown below still runs)
                pass
            ray.shutdown()
        children += [c for c in psutil.Process().children(recursive=True) if c not in children]
        _, alive = psutil.wait_procs(children, timeout=wait_s)
        killed = []
        for p in alive:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return killed
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: list[str] | None, start, cluster_env=None) -> int:
    """The CLI; `start(opts, host, port, replicas, actor_options, timeout_s) -> url` deploys the service
    on the connected Ray, and `cluster_env(opts, databases) -> {name: value}` is the environment a cluster
    we start gets (launch/serve.py's, passed in: this module never imports Ray Serve's application)."""
    from launch.serve_http import ServeOptions, find_databases, host_refusal, key_digest
    from observe.logs import quiet_cpu_host

    quiet_cpu_host()
    p = argparse.ArgumentParser(prog="python -m launch.serve", description="A text-to-SQL service over a "
                                "checkpoint: Ray Serve HTTP, batched generation, sandboxed execution.")
    p.add_argument("--model", required=True, help="a Hugging Face export, e.g. runs/<run>/hf/step_<N>")
    p.add_argument("--bird-dir", required=True, help="holds <split>_databases/<db_id>/<db_id>.sqlite")
    p.add_argument("--split", default="dev")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1",
                   help="the HTTP proxy's address (loopback by default; any other needs an API key)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but "
                   "/healthz (default $ARL_API_KEY; prefer it: a command line is visible to every user in ps)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-wait-s", type=float, default=0.02)
    p.add_argument("--max-tokens", type=int, default=0, help="new tokens per answer (0: the export's)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--sql-workers", type=int, default=2, help="sandbox worker processes per replica")
    p.add_argument("--sql-max-workers", type=int, default=8,
                   help="the sandbox pool grows to this while every worker is busy (runaway queries)")
    p.add_argument("--replica-nice", type=int, default=10,
                   help="model replicas (generation, their SQL workers) run this many nice levels below the "
                   "proxy and /healthz, which then answer at once on a busy host (0: the same level)")
    p.add_argument("--gpus-per-replica", type=float, default=None, help="default 1 with vllm, 0 otherwise")
    p.add_argument("--ray-address", default="", help="join this cluster (default: start our own, local)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get("ARL_API_KEY")
    refusal = host_refusal(args.host, api_key)  # first: who may get in decides whether we start at all
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    from launch.export import ExportError, default_engine, read_settings

    try:
        if args.replicas < 1 or args.max_batch_size < 1 or not 0 < args.port < 65536:
            raise ValueError("--replicas and --max-batch-size must be >= 1 and --port in 1..65535")
        if not 0 <= args.replica_nice <= 19:
            raise ValueError("--replica-nice must be in 0..19")
        if not 1 <= args.sql_workers <= args.sql_max_workers:
            raise ValueError("--sql-workers must be >= 1 and at most --sql-max-workers")
        read_settings(args.model)
        dbs = find_databases(args.bird_dir, args.split)
        check_port(args.host, args.port)
    except (ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tempfile

    engine = args.engine or default_engine()  # decided here: a replica without a GPU would not see one
    interrupt_on_sigterm()
    temp_dir = None
    try:
        import ray

        from launch.local_ray import init_local_ray, ray_on_loopback

        opts = ServeOptions(model=str(Path(args.model).resolve()), bird_dir=str(Path(args.bird_dir).resolve()),
                            split=args.split, engine=engine, device=args.device, max_batch_size=args.max_batch_size,
                            batch_wait_s=args.batch_wait_s, max_tokens=args.max_tokens, sql_workers=args.sql_workers,
                            sql_max_workers=args.sql_max_workers, api_key_sha256=key_digest(api_key),
                            replica_nice=args.replica_nice)
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:
            temp_dir = tempfile.mkdtemp(prefix="arl-serve-ray-")
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            # our cluster's proxy answers /healthz itself (launch/serve_health.py): its processes inherit these
            os.environ.update(cluster_env(opts, len(dbs)) if cluster_env else {})
            with ray_on_loopback(True):  # Ray's own sockets on 127.0.0.1, as the training launcher's
                init_local_ray(None, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
        interrupt_on_sigterm()  # again: ray.init installs its own handler (sys.exit(15), skipping the message)
        actor_options = {"num_cpus": args.cpus_per_replica}
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(engine == "vllm")
        if gpus:
            actor_options["num_gpus"] = gpus
        url = start(opts, args.host, args.port, args.replicas, actor_options, args.start_timeout)
        db = next(iter(dbs))
        key_ref = "$ARL_API_KEY" if args.api_key is None else "<your key>"
        auth = f" -H \"Authorization: Bearer {key_ref}\"" if api_key else ""
        print(f"ready: serving {args.model} on {url} ({len(dbs)} databases, {args.replicas} replica(s)"
              f"{', API key required' if api_key else ''}); Ctrl-C stops\n"
              f"  page:   {url}/\n"
              f"  ask:    curl -s{auth} {url}/v1/sql -d '{{\"db_id\": \"{db}\", \"question\": \"How many rows?\", "
              f"\"execute\": true}}'\n"
              f"  openai: base_url {url}/v1, model arl-sql/{db}{', api_key your key' if api_key else ''}", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (ours, or ray.init's exit(15) while it starts)
        return 0
    except Exception as e:  # noqa: BLE001  (a deploy that failed or timed out: one line, then the clean stop)
        from queues.errors import one_line

        print(f"error: the service did not start: {one_line(e)}", file=sys.stderr)
        return 1
    finally:
        stop(temp_dir)
        print("stopped", file=sys.stderr, flush=True)
