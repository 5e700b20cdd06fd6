"""The learner ranks' rendezvous, run inside each rank: rank 0 binds the world's TCPStore, every
rank joins the process group.

Invariants:
- Every wait is bounded: the store and the process group are created with a timeout
  (COLLECTIVE_TIMEOUT_S unless given), so a rank that never arrives fails the join in one line
  instead of hanging it.
- The store listens on this node's address alone, on a free port.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

COLLECTIVE_TIMEOUT_S = 1800.0  # the learner's process group and store: a model load, a checkpoint


def bind_store(world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S, host: str | None = None):
    """Rank 0: the world's TCPStore on this node's address alone, on a free port. Returns (store, host, port)."""
    from weights import broadcast as wsb

    host = host or wsb.node_ip()
    try:
        store = wsb.bind_store(host, world_size, datetime.timedelta(seconds=timeout_s))
    except OSError as e:
        raise RuntimeError(f"learner rendezvous: cannot listen on {host}: {e}") from None
    return store, host, store.port


def init_world(rank: int, world_size: int, backend: str, store: Any = None, host: str = "", port: int = 0,
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Joins this process to the learner's default process group (rank 0 passes its own store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # DeepSpeed and the learner read these; each rank sees only its own GPU (Ray sets
    # CUDA_VISIBLE_DEVICES per actor), so its local device index is 0.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


# ----------------------------------------------------------------------------- the group (caller side)
