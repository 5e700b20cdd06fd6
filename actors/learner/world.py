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
- Importing this module imports no torch (the launcher calls `world_hosts` when a learner group of
  several ranks joins; torch and weights.broadcast are imported inside the functions that run in a rank).
- Gloo binds what the caller names, never what the host name resolves to (gloo's default, loopback on
  some hosts and a public interface on others): `local_host` is loopback when every rank runs on one
  node (the group decides: `world_hosts`) and the node address Ray reports otherwise; every gloo group
  of the process (DeepSpeed's too) gets it through GLOO_SOCKET_IFNAME, the interface holding that
  address, unless the user set GLOO_SOCKET_IFNAME. A world of one (actors/learner/engine.py) binds
  loopback.
"""
from __future__ import annotations

import datetime
import os
from typing import Any


def bind_store(world_size: int, timeout_s: float, host: str | None = None):
    """Rank 0: the world's TCPStore on this node's address alone, on a free port. Returns (store, host, port)."""
    from weights import broadcast as wsb

    host = host or wsb.node_ip()
    try:
        store = wsb.bind_store(host, world_size, datetime.timedelta(seconds=timeout_s))
    except OSError as e:
        raise RuntimeError(f"learner rendezvous: cannot listen on {host}: {e}") from None
    return store, host, store.port


LOOPBACK = "127.0.0.1"


def world_hosts(node_ips: list[str]) -> tuple[str, list[str]]:
    """(the store's host, each rank's local gloo address) for ranks on `node_ips` (Ray's node address of
    each rank, rank 0 first): loopback for all when they share one node, else the node addresses."""
    if len(set(node_ips)) <= 1:
        return LOOPBACK, [LOOPBACK] * len(node_ips)
    return node_ips[0], list(node_ips)


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds `address` (None when none does)."""
    import ipaddress

    import psutil

    if ipaddress.ip_address(address).is_loopback:
        address = LOOPBACK if ":" not in address else address
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def bind_gloo_to(local_host: str) -> None:
    """Every gloo group this process creates from now on binds the interface holding `local_host`
    (GLOO_SOCKET_IFNAME, read by each group as it is made), unless the user chose one."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(local_host)
    if name is None:
        raise RuntimeError(f"learner rendezvous: no network interface of this host holds {local_host}")
    os.environ["GLOO_SOCKET_IFNAME"] = name


def init_world(rank: int, world_size: int, backend: str, timeout_s: float, store: Any = None, host: str = "",
               port: int = 0, local_host: str | None = None) -> None:
    """Joins this process to the learner's default process group (rank 0 passes its own store). Gloo
    binds `local_host` (default: loopback when the store is on loopback, else this node's address)."""
    import ipaddress

    import torch.distributed as dist

    from weights.broadcast import node_ip

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        bind_gloo_to(local_host or (LOOPBACK if ipaddress.ip_address(host or LOOPBACK).is_loopback else node_ip()))
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # DeepSpeed and the learner read these; each rank sees only its own GPU (Ray sets
    # CUDA_VISIBLE_DEVICES per actor), so its local device index is 0.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    init_bounded(backend, timeout_s, store=store, rank=rank, world_size=world_size)


def init_bounded(backend: str, timeout_s: float, **kwargs) -> None:
    """dist.init_process_group with `timeout_s`, after making it every later group's default too."""
    import torch.distributed as dist

    from weights.broadcast import nccl_async_error_handling

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
