"""Weight sync by broadcast: a private NCCL (GPU) or gloo (CPU) group, learner rank 0 sending.

Invariants:
- Nothing here touches ``torch.distributed``'s default process group: the group is built from its
  own TCPStore (bound to this node's address alone, never every interface), so the learner's
  DeepSpeed group and vLLM's own groups are left alone. Rank 0 is the learner; ranks 1.. are the
  receiving processes (one per generator, or one per vLLM worker when the engine's workers join
  through its worker extension).
- Every rank runs the same broadcasts in the same order (the plan's dtype order), even a receiver
  that refused a bucket: it still takes part, reports its error through the store, and raises at
  the end, so the sender never hangs on it; the sender aborts the rest of the sync as soon as it
  sees the report, and every receiver reads that abort before the keys are reused.
- Every wait is bounded by the rendezvous timeout (the learner's `learner.collective_timeout_s`, the
  group's own and its store's; NCCL with async error handling on); ``close()`` from another thread
  ends a send that waits on a dead receiver within a second (NCCL groups are aborted, not left hanging).
- ``send`` returns only after every receiver acknowledged the summary; a receiver's version moves
  only when it received the whole sync (weights.base).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from weights.base import ReceiverBase, SenderBase
from weights.wire import (
    BucketPlan,
    Expected,
    ExportWeights,
    LoadWeights,
    SyncAbort,
    SyncSummary,
    WeightSyncError,
    decode_message,
    encode_message,
    flatten_bucket,
    unflatten_bucket,
)

if TYPE_CHECKING:
    import torch


def group_layout(ranks_per_receiver: list[int]) -> tuple[list[int], int]:
    """The private group's ranks: the learner is rank 0, receiver i (a generator whose engine has k
    workers, e.g. vLLM with tensor parallelism k) takes k consecutive ranks from first_ranks[i].
    Returns (first_ranks, world_size)."""
    firsts, nxt = [], 1
    for i, k in enumerate(ranks_per_receiver):
        if int(k) < 1:
            raise ValueError(f"weight_sync nccl: generator {i} asks for {k} ranks in the group; each needs >= 1")
        firsts.append(nxt)
        nxt += int(k)
    return firsts, nxt


@dataclass(frozen=True)
class Rendezvous:
    """Where the private weight-sync group meets; the learner makes it, the coordinator passes it on."""

    host: str
    port: int
    world_size: int  # 1 (the learner) + every receiving process's ranks (group_layout)
    backend: str  # "nccl" or "gloo"
    timeout_s: float


def node_ip() -> str:
    """This node's address as Ray sees it (falls back to the hostname's address)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - any failure falls back to the hostname
        pass
    return socket.gethostbyname(socket.gethostname())


def bind_store(host: str, world_size: int, timeout: datetime.timedelta) -> Any:
    """A TCPStore server (is_master) on `host` alone, on a free port (read it from `.port`); also the
    learner group's rendezvous (actors/learner/group.py).

    torch's TCPStore server would listen on every interface: it is handed a socket bound to
    this node's address alone (127.0.0.1 in a local run); the store owns it. Raises OSError.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(max(128, world_size))
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def nccl_async_error_handling() -> None:
    """NCCL's watchdog enforces a group's timeout only with async error handling on: it is set (torch's
    default mode 3, which ends the process) unless given, and an explicit 0 is overridden, with a warning.
    Read by each NCCL group as it is created."""
    import logging
    import os

    if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip() == "0":
        logging.getLogger("arctic_rl.weights").warning(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 would let a collective on a dead peer hang past its timeout; using 3")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")


def _make_group(store: Any, rank: int, world_size: int, backend: str, timeout: datetime.timedelta,
                local_host: str) -> Any:
    """A process group of our own; torch.distributed's default group is neither read nor set."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("arl-weight-sync/pg", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise WeightSyncError("weight_sync backend 'nccl' needs a CUDA build of torch; use 'gloo' on CPU")
        nccl_async_error_handling()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise WeightSyncError(f"weight_sync backend must be 'nccl' or 'gloo', got {backend!r}")


def _header_key(version: int, index: int) -> str:
    return f"arl-weight-sync/v{version}/bucket/{index}"


def _error_key(version: int) -> str:
    return f"arl-weight-sync/v{version}/error"


def _ack_key(version: int, rank: int) -> str:
    return f"arl-weight-sync/v{version}/ack/{rank}"


class _Broadcaster:
    def _broadcast(self, plan: BucketPlan, buffers: Mapping[str, torch.Tensor]) -> None:
        import torch
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with context:  # this may run on a worker thread, whose current CUDA device is 0
            for dname, nbytes in plan.buffer_nbytes.items():  # the plan's order, identical on every rank
                if nbytes:  # gloo never completes a zero-byte broadcast
                    self._group.broadcast([buffers[dname]], options).wait()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()


class BroadcastSender(SenderBase, _Broadcaster):
    """Learner side (rank 0) of a private NCCL/gloo group. Calls, in order:

        rdv = sender.listen(world_size)         # binds the TCPStore now, returns host/port
        sender.init()                            # concurrently with every receiver.init(rdv, rank)
        summary = sender.send(version)           # concurrently with every receiver.receive_all(version)
        sender.close()

    `send` returns only after every receiver confirmed (or raises naming the receiver that failed).
    """

    def __init__(self, export_weights: ExportWeights, bucket_mb: float, backend: str = "nccl",
                 device: torch.device | str | None = None, timeout_s: float = 600.0):
        super().__init__(export_weights, bucket_mb)
        if backend not in ("nccl", "gloo"):
            raise WeightSyncError(f"weight_sync backend must be 'nccl' or 'gloo', got {backend!r}")
        self.backend = backend
        self.device = device if device is not None else ("cuda" if backend == "nccl" else "cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = None
        self._group = None
        self._rendezvous: Rendezvous | None = None
        self._last_version: int | None = None
        # Set by close() from another thread: a send still waiting on a dead rank gives up at once
        # (the coordinator has replaced the group) instead of holding its thread for `timeout`.
        self._closed = threading.Event()

    def listen(self, world_size: int, host: str | None = None) -> Rendezvous:
        if world_size < 2:
            raise WeightSyncError(f"a weight-sync group needs the learner and >= 1 generator, world_size={world_size}")
        host = host or node_ip()
        try:
            self._store = bind_store(host, world_size, self.timeout)
        except OSError as e:
            raise WeightSyncError(f"weight sync: cannot listen on {host}: {e}") from None
        self._rendezvous = Rendezvous(host=host, port=self._store.port, world_size=world_size,
                                      backend=self.backend, timeout_s=self.timeout.total_seconds())
        return self._rendezvous

    def init(self) -> None:
        if self._rendezvous is None:
            raise WeightSyncError("call listen(world_size) before init()")
        rdv = self._rendezvous
        self._group = _make_group(self._store, 0, rdv.world_size, self.backend, self.timeout, rdv.host)

    def send(self, version: int) -> SyncSummary:
        if self._group is None:
            raise WeightSyncError("call init() (concurrently with the receivers') before send()")
        store, receivers = self._store, range(1, self._rendezvous.world_size)
        self._forget(self._last_version)
        self._last_version = version
        self.start(version)
        try:
            while True:
                if store.check([_error_key(version)]):
                    reason = store.get(_error_key(version)).decode()
                    raise WeightSyncError(f"weight sync v{version} aborted: {reason}")
                named = self._next_named()
                if named is None:
                    break
                plan, buffers = flatten_bucket(named, version, self._index, device=self.device)
                del named
                store.set(_header_key(version, plan.index), encode_message(plan))
                self._broadcast(plan, buffers)
                del buffers
                self._count(plan)
            summary = self._summary()
            store.set(_header_key(version, summary.num_buckets), encode_message(summary))
            acks = [_ack_key(version, rank) for rank in receivers]
            self._wait(store, acks)
            failures = [store.get(k).decode() for k in acks]
            failures = [f for f in failures if f != "ok"]
            if failures:
                raise WeightSyncError(f"weight sync v{version} failed on receivers: {'; '.join(failures)}")
            return summary
        except BaseException as exc:
            if self._buckets is not None:  # stopped mid-stream: tell the receivers instead of leaving them waiting
                store.set(_header_key(version, self._index),
                          encode_message(SyncAbort(version=version, reason=f"sender: {exc}")))
                try:
                    # Wait until every receiver has read the abort: the next send() deletes this
                    # version's keys, and a receiver that had not read it yet would wait forever.
                    self._wait(store, [_ack_key(version, rank) for rank in receivers])
                except Exception:  # noqa: BLE001 - a receiver stuck in a broken broadcast; keep exc
                    pass
            self.abort()
            raise

    def _wait(self, store: Any, keys: list[str]) -> None:
        """store.wait(keys) for up to `timeout`, in 1 s slices so that close() ends it early."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self._closed.is_set():
                raise WeightSyncError("weight-sync group closed (replaced) while waiting for receivers")
            left = deadline - time.monotonic()
            try:
                store.wait(keys, datetime.timedelta(seconds=max(0.01, min(1.0, left))))
                return
            except RuntimeError:  # DistStoreError: not yet
                if left <= 1.0:
                    raise WeightSyncError(f"weight sync: receivers did not answer within {self.timeout}") from None

    def _forget(self, version: int | None) -> None:
        """Deletes the previous sync's keys: every receiver acked it, so nobody reads them again."""
        if version is None:
            return
        keys = [_error_key(version)] + [_ack_key(version, r) for r in range(1, self._rendezvous.world_size)]
        keys += [_header_key(version, i) for i in range(self._index + 2)]
        for key in keys:
            self._store.delete_key(key)

    def close(self) -> None:
        """Safe from another thread while send() is blocked on a dead rank: that send raises
        WeightSyncError within a second instead of waiting out the group timeout."""
        self._closed.set()
        group, self._group, self._store = self._group, None, None
        if group is not None:
            if self.backend == "nccl" and hasattr(group, "abort"):
                group.abort()  # unblocks a broadcast stuck on a dead peer (gloo fails those itself)
            elif hasattr(group, "shutdown"):
                group.shutdown()


class BroadcastReceiver(ReceiverBase, _Broadcaster):
    """Generator side: one rank (1..world_size-1) of the private group. Calls, in order:

        receiver.init(rdv, rank)                 # concurrently with the sender's init()
        version = await receiver.receive_all(v)  # concurrently with the sender's send(v)

    On a bad header or a failed load this rank keeps taking part in the broadcasts (so the sender
    never hangs), reports the error through the store, and raises at the end; the sender aborts
    the rest of the sync as soon as it sees the report.
    """

    def __init__(self, load_weights: LoadWeights, expected: Expected | None = None,
                 device: torch.device | str | None = None):
        super().__init__(load_weights, expected, device)
        self.rank: int | None = None
        self._store = None
        self._group = None

    def init(self, rendezvous: Rendezvous, rank: int, local_host: str | None = None) -> None:
        import torch.distributed as dist

        if not 1 <= rank < rendezvous.world_size:
            raise WeightSyncError(f"receiver rank must be in 1..{rendezvous.world_size - 1}, got {rank}")
        if self.device is None:
            self.device = "cuda" if rendezvous.backend == "nccl" else "cpu"
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self.rank = rank
        self._store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size,
                                    is_master=False, timeout=timeout)
        if local_host is None:
            local_host = "127.0.0.1" if _is_loopback(rendezvous.host) else node_ip()
        self._group = _make_group(self._store, rank, rendezvous.world_size, rendezvous.backend, timeout, local_host)

    async def receive_all(self, version: int) -> int:
        import torch

        if self._group is None:
            raise WeightSyncError("call init(rendezvous, rank) before receive_all()")
        store = self._store
        failure: str | None = None

        def fail(exc: BaseException) -> str:
            reason = f"receiver rank {self.rank}: {exc}"
            store.set(_error_key(version), reason)  # before the next broadcast, so the sender sees it soon
            return reason

        self._reset(version)
        index = 0
        while True:
            raw = await asyncio.to_thread(store.get, _header_key(version, index))
            message = decode_message(raw)
            if isinstance(message, SyncAbort):
                store.set(_ack_key(version, self.rank), "aborted")  # the sender waits for this
                self._abort(message)
            if isinstance(message, SyncSummary):
                if failure is None:
                    try:
                        result = self._finish(message)
                    except WeightSyncError as exc:
                        failure = f"receiver rank {self.rank}: {exc}"
                store.set(_ack_key(version, self.rank), failure or "ok")
                if failure is not None:
                    self._reset(None)
                    raise WeightSyncError(failure)
                return result
            plan = message
            if failure is None:
                try:
                    if plan.version != version:
                        raise WeightSyncError(f"bucket of v{plan.version} arrived during the sync of v{version}")
                    self._check_plan(plan)
                except WeightSyncError as exc:
                    failure = fail(exc)
            # Allocated from byte counts alone, so this rank can take part even in a bucket it refused.
            buffers = {d: torch.empty(n, dtype=torch.uint8, device=self.device) for d, n in plan.buffer_nbytes.items()}
            await asyncio.to_thread(self._broadcast, plan, buffers)
            if failure is None:
                try:
                    await self._load(plan, unflatten_bucket(plan, buffers))
                except Exception as exc:  # noqa: BLE001 - reported to the sender, re-raised at the end
                    failure = fail(exc)
            del buffers
            index += 1

    def close(self) -> None:
        if self._group is not None and hasattr(self._group, "shutdown"):
            self._group.shutdown()
        self._group = self._store = None
