"""The learner ranks' rendezvous, run inside each rank: rank 0 binds the world's TCPStore, every
rank joins the process group; and what a broken collective is.

Invariants:
- Every wait is bounded by `learner.collective_timeout_s` (the caller passes it): the store, the
  process group, and every group created in this process afterwards (DeepSpeed's own data-parallel
  groups are made by `new_group` without a timeout, which would otherwise get torch's 30 min / 10 min
  defaults). A rank that never arrives fails the join in one line; a peer that dies or hangs in the
  middle of a collective fails it on every survivor within the bound instead of hanging it.
- On GPUs NCCL's asynchronous error handling is on (TORCH_NCCL_ASYNC_ERROR_HANDLING, never 0): its
  watchdog ends a process whose NCCL collective ran past the timeout, so Ray reports the rank dead.
- `is_collective_failure` names what the launcher relaunches on besides a dead actor: a collective
  that failed on a peer (gloo's transport errors, torch's DistError), since the world cannot go on.
- The store listens on this node's address alone, on a free port.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

from weights.broadcast import nccl_async_error_handling


def bind_store(world_size: int, timeout_s: float, host: str | None = None):
    """Rank 0: the world's TCPStore on this node's address alone, on a free port. Returns (store, host, port)."""
    from weights import broadcast as wsb

    host = host or wsb.node_ip()
    try:
        store = wsb.bind_store(host, world_size, datetime.timedelta(seconds=timeout_s))
    except OSError as e:
        raise RuntimeError(f"learner rendezvous: cannot listen on {host}: {e}") from None
    return store, host, store.port


def init_world(rank: int, world_size: int, backend: str, timeout_s: float, store: Any = None, host: str = "",
               port: int = 0) -> None:
    """Joins this process to the learner's default process group (rank 0 passes its own store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # DeepSpeed and the learner read these; each rank sees only its own GPU (Ray sets
    # CUDA_VISIBLE_DEVICES per actor), so its local device index is 0.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    init_bounded(backend, timeout_s, store=store, rank=rank, world_size=world_size)


def init_bounded(backend: str, timeout_s: float, **kwargs) -> None:
    """dist.init_process_group with `timeout_s`, after making it every later group's default too."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        nccl_async_error_handling()
    bound_new_groups(timeout)
    dist.init_process_group(backend, timeout=timeout, **kwargs)


def bound_new_groups(timeout: datetime.timedelta) -> None:
    """Makes `timeout` the default of every process group this process creates from now on.

    `new_group(ranks)` without a timeout takes torch's module defaults (30 min, NCCL 10 min), not the
    world's; DeepSpeed creates its groups that way (deepspeed.comm has no timeout argument). torch reads
    those defaults at each call, so setting them here bounds DeepSpeed's groups by our value as well.
    """
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None: a torch built without NCCL
        c10d.default_pg_nccl_timeout = timeout


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed on a peer: torch's DistError (NCCL, the store) or an
    error of gloo's transport (a peer closed its connection, or a wait ran past the group's timeout)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and "/gloo/transport/" in str(exc)
