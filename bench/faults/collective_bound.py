"""A learner rank lost in the middle of a collective: how, and how soon, the survivor fails.

    python -m bench.faults.collective_bound                          # CPU: gloo, 2 processes
    python -m bench.faults.collective_bound --backend nccl           # 2 GPUs (one process each)
    python -m bench.faults.collective_bound --signal kill --timeout-s 20

Two processes join a world as the learner ranks do (actors/learner/world.py: init_world with the
bound, NCCL's async error handling on) and make a second group the way DeepSpeed makes its ZeRO groups
(`new_group` without a timeout). After a warm-up all-reduce on both, rank 1 stops taking part and is
SIGSTOPped (alive, silent: a stuck GPU, a lost node) or SIGKILLed, while rank 0 all-reduces on the
DeepSpeed-made group, then on the world. Prints one JSON line: how rank 0 ended (an exception, with
its first line, or its process ended by NCCL's watchdog: a signal or exit code) and the seconds from
the loss to that end, against the bound. On GPUs the NCCL collective is asynchronous: rank 0 waits in
`torch.cuda.synchronize()`, which only the watchdog can end.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time

IMPORT_S = 300.0  # a spawned process imports torch (and initialises CUDA) within this


def join_pair(rank: int, backend: str, timeout_s: float, ports, joins, wait_s: float = IMPORT_S,
              local_host: str | None = None) -> int:
    """One of two local processes joins a world as the learner ranks do (actors/learner/world.py, with
    the bound `timeout_s`): rank 0 binds the store on loopback and hands its port through `ports` (a
    multiprocessing queue), rank 1 takes it; both start the join together at `joins` (a barrier of 2),
    since imports on a loaded machine take longer than the bound. Gloo binds `local_host` (default
    loopback). Returns the store's port. Used here and by tests/integration/test_collective_bounds.py."""
    from actors.learner.world import LOOPBACK, bind_store, init_world

    if rank == 0:
        store, host, port = bind_store(2, timeout_s, host=LOOPBACK)
        ports.put(port)
    else:
        store, host, port = None, LOOPBACK, ports.get(timeout=wait_s)
    joins.wait(wait_s)
    init_world(rank, 2, backend, timeout_s, store=store, host=host, port=port, local_host=local_host)
    return port


def _rank(rank: int, backend: str, timeout_s: float, ports, joins, out) -> None:
    import torch
    import torch.distributed as dist

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        join_pair(rank, backend, timeout_s, ports, joins)
        groups = [("deepspeed-style new_group", dist.new_group([0, 1])), ("world", dist.group.WORLD)]
        x = torch.ones(1 << 20, device=device)
        for _, group in groups:
            dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.put(("ready", os.getpid(), os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "(unset)")))
        if rank == 1:
            time.sleep(3600)  # stopped or killed by the parent; never enters the next collective
        for name, group in groups:
            try:
                dist.all_reduce(x, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # an NCCL collective on a silent peer: the watchdog ends us
                out.put(("returned", name, time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - the survivor's collective failed: what we measure
                out.put(("raised", f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", time.monotonic()))
                return
    except BaseException as exc:  # noqa: BLE001
        out.put(("crash", repr(exc)[:500], time.monotonic()))


def run(backend: str, timeout_s: float, sig: str) -> dict:
    ctx = mp.get_context("spawn")
    ports, joins, outs = ctx.Queue(), ctx.Barrier(2), [ctx.Queue(), ctx.Queue()]  # a queue per rank
    procs = [ctx.Process(target=_rank, args=(r, backend, timeout_s, ports, joins, outs[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    result: dict = {"backend": backend, "bound_s": timeout_s, "signal": sig}
    try:
        pids = []
        for q in outs:
            kind, value, env = q.get(timeout=IMPORT_S)
            if kind != "ready":
                return dict(result, outcome=f"{kind}: {value}")
            pids.append(value)
            result["rank_TORCH_NCCL_ASYNC_ERROR_HANDLING"] = env
        lost = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP if sig == "stop" else signal.SIGKILL)
        deadline = lost + 3 * timeout_s + 60
        while time.monotonic() < deadline:
            try:
                kind, what, at = outs[0].get(timeout=0.5)
                return dict(result, outcome=f"{kind}: {what}", seconds_after_loss=round(at - lost, 2))
            except queue_mod.Empty:
                if not procs[0].is_alive():  # ended without a word: NCCL's watchdog tore it down
                    code = procs[0].exitcode
                    how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
                    return dict(result, outcome=f"rank 0's process ended ({how})",
                                seconds_after_loss=round(time.monotonic() - lost, 2))
        return dict(result, outcome=f"HANG: rank 0 still waiting {3 * timeout_s + 60:.0f} s after the loss")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults.collective_bound", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--timeout-s", type=float, default=20.0, help="learner.collective_timeout_s of the world")
    p.add_argument("--signal", choices=("stop", "kill"), default="stop", dest="sig")
    a = p.parse_args(argv)
    result = run(a.backend, a.timeout_s, a.sig)
    print(json.dumps(result))
    return 0 if "seconds_after_loss" in result and not result["outcome"].startswith("returned") else 1


if __name__ == "__main__":
    raise SystemExit(main())
