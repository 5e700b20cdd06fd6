"""Weight sync by CUDA IPC: learner and engine on the same physical GPU, zero copies over the wire.

Invariants:
- A ``CudaIpcBucket`` carries the bucket's plan ONCE and, per GPU (keyed by the device's uuid, the
  one name every process agrees on whatever its CUDA_VISIBLE_DEVICES), the IPC handles of that GPU's
  flat buffers: one handle per dtype. One sender exports one GPU's entry; the learner group, where
  every rank exports the same bucket on its own GPU, merges the ranks' messages with
  ``merge_ipc_buckets``, which refuses ranks that disagree on the plan or share a GPU.
- A receiver opens only the handle of its own GPU (``select_ipc_handles``): a vLLM tensor-parallel
  worker the one of ``self.device``, the transformers engine the one of its device. A message with no
  handle for a GPU visible to the receiver is a one-line error naming the uuids on both sides.
- The sender keeps a bucket's buffers alive until its next ``next_bucket()``/``abort()``, which the
  coordinator makes only after every receiver returned; a receiver returns only after its copies out
  of the buffers finished (stream synchronised). At the end of a sync the sender hands its cached
  blocks back to the device (``torch.cuda.empty_cache``), so the engine's KV-cache wake finds them.
- The rebuilt tensors are used only inside the receiving call and dropped before it returns, so the
  sender's ``torch.cuda.ipc_collect`` can free the blocks.
- Across an RPC that cannot carry these tuples (vLLM's msgpack), the message travels as
  ``ipc_message_to_bytes`` (pickle of plan bytes and handle tuples: no tensor data) and is opened by
  the worker itself; the bytes come from our own learner through our own generator.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

from weights.base import ReceiverBase, SenderBase, maybe_await
from weights.bucketed import BucketedTransport
from weights.protocol import TransportKey, WorkerStep, in_workers
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

Handles = dict[str, tuple]  # dtype -> torch.multiprocessing.reductions.reduce_tensor(buffer)


@dataclass
class CudaIpcBucket:
    """One bucket as CUDA IPC handles into flat buffers on one or more GPUs (same host)."""

    plan: bytes
    handles: dict[str, Handles]  # device uuid -> that GPU's handles

    @property
    def device_uuids(self) -> list[str]:
        return list(self.handles)


IpcMessage = CudaIpcBucket | SyncSummary | SyncAbort


def device_uuid(device: torch.device | str | int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(torch.device("cuda", device) if isinstance(device, int)
                                                else torch.device(device)).uuid)


def visible_cuda_uuids() -> dict[str, int]:
    """uuid -> CUDA index in this process (after CUDA_VISIBLE_DEVICES)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def merge_ipc_buckets(messages: Sequence[IpcMessage]) -> IpcMessage:
    """The learner group's ranks' `next_bucket()` results for one step of a sync -> one message.

    Buckets: the plan once (every rank must export the identical plan), the handles of every rank's
    GPU keyed by uuid (no GPU twice). Summaries: identical on every rank, returned once. An abort from
    any rank is the merged message (the others' buffers are released by their abort()).
    """
    if not messages:
        raise WeightSyncError("merge_ipc_buckets: no messages (a learner group has at least one rank)")
    for message in messages:
        if isinstance(message, SyncAbort):
            return message
    kinds = {type(m).__name__ for m in messages}
    if len(kinds) > 1:
        where = ", ".join(f"rank {i}: {_describe(m)}" for i, m in enumerate(messages))
        raise WeightSyncError(f"merge_ipc_buckets: learner ranks are out of step ({where})")
    first = messages[0]
    if isinstance(first, SyncSummary):
        for rank, m in enumerate(messages[1:], 1):
            for field in ("version", "num_buckets", "num_tensors", "nbytes"):
                if getattr(m, field) != getattr(first, field):
                    raise WeightSyncError(f"merge_ipc_buckets: summary.{field} is {getattr(m, field)} on rank {rank}, "
                                          f"{getattr(first, field)} on rank 0")
        return first
    if not isinstance(first, CudaIpcBucket):
        raise WeightSyncError(f"merge_ipc_buckets: expected CudaIpcBucket messages, got {type(first).__name__}")
    handles: dict[str, Handles] = {}
    owner: dict[str, int] = {}
    for rank, m in enumerate(messages):
        if m.plan != first.plan:
            a, b = decode_message(first.plan), decode_message(m.plan)
            raise WeightSyncError(f"merge_ipc_buckets: rank {rank}'s plan differs from rank 0's "
                                  f"(v{b.version} bucket {b.index}, {len(b.tensors)} tensors vs "
                                  f"v{a.version} bucket {a.index}, {len(a.tensors)} tensors)")
        for uuid, h in m.handles.items():
            if uuid in handles:
                raise WeightSyncError(f"merge_ipc_buckets: ranks {owner[uuid]} and {rank} both export on GPU {uuid}")
            handles[uuid], owner[uuid] = h, rank
    return CudaIpcBucket(plan=first.plan, handles=handles)


def _describe(message: Any) -> str:
    if isinstance(message, CudaIpcBucket):
        plan = decode_message(message.plan)
        return f"bucket {plan.index} of v{plan.version}"
    if isinstance(message, SyncSummary):
        return f"summary of v{message.version}"
    return type(message).__name__


def select_ipc_handles(message: CudaIpcBucket, visible: Mapping[str, int], prefer: int | None = None) -> tuple[int, Handles]:
    """(local CUDA index, handles) of the GPU this receiver reads from: `prefer` (its own device's
    index) when the message has that GPU, else the first of the message's GPUs visible here."""
    if prefer is not None:
        for uuid, index in visible.items():
            if index == prefer and uuid in message.handles:
                return index, message.handles[uuid]
    for uuid, handles in message.handles.items():
        if uuid in visible:
            return visible[uuid], handles
    raise WeightSyncError(
        f"CUDA IPC weight sync: the bucket has handles for GPU(s) {sorted(message.handles)}, this process sees "
        f"{sorted(visible) or 'no GPU'}; the learner rank must share the engine's GPU (use nccl across GPUs)")


def open_ipc_buffers(handles: Handles, local_index: int) -> dict[str, torch.Tensor]:
    """Rebuilds each dtype's flat uint8 buffer from its (rebuild, args) handle on CUDA `local_index`."""
    buffers = {}
    for dname, (rebuild, args) in handles.items():
        args = list(args)
        args[6] = local_index  # rebuild_cuda_tensor's storage_device: the sender's index, not ours
        buffers[dname] = rebuild(*args)
    return buffers


def ipc_message_to_bytes(message: CudaIpcBucket) -> bytes:
    """What an engine RPC that carries only plain types (vLLM's msgpack) can carry: no tensor data."""
    return pickle.dumps((message.plan, message.handles), protocol=pickle.HIGHEST_PROTOCOL)


def ipc_message_from_bytes(data: bytes) -> CudaIpcBucket:
    plan, handles = pickle.loads(data)  # noqa: S301 - our own learner's handles, through our own generator
    return CudaIpcBucket(plan=plan, handles=handles)


def load_ipc_bucket(message: CudaIpcBucket, device: torch.device | str, load: Callable[[list], Any],
                    uuid: str | None = None) -> BucketPlan:
    """Inside the process that owns `device` (a vLLM worker): open this GPU's handles only, hand the
    views (plan order) to `load`, wait for the copies, drop the views. Returns the plan. `uuid` is
    the device's (read from CUDA when None; tests on CPU pass one)."""
    import torch

    plan = decode_message(message.plan)
    if not isinstance(plan, BucketPlan):
        raise WeightSyncError(f"CUDA IPC message holds a {type(plan).__name__}, not a bucket")
    device = torch.device(device)
    index = device.index if device.index is not None else 0
    index, handles = select_ipc_handles(message, {uuid or device_uuid(device): index})
    buffers = open_ipc_buffers(handles, index)
    try:
        load(unflatten_bucket(plan, buffers))
        if device.type == "cuda":
            torch.cuda.current_stream(index).synchronize()  # our return lets the sender free the buffers
    finally:
        del buffers
    return plan


class CudaIpcSender(SenderBase):
    """Learner side. Each bucket is flattened into fresh buffers on `device`; their handles go out
    and the buffers stay alive until the next `next_bucket()`/`abort()` call, which the
    coordinator makes only after every receiver acked (returned from `receive`)."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float, device: torch.device | str | None = None):
        import torch

        super().__init__(export_weights, bucket_mb)
        self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        self._in_flight: dict[str, torch.Tensor] | None = None
        self._uuid: str | None = None

    def _release(self) -> None:
        if self._in_flight is not None:
            import torch

            self._in_flight = None
            torch.cuda.ipc_collect()  # frees blocks whose IPC ref counts the receivers dropped

    def next_bucket(self) -> CudaIpcBucket | SyncSummary:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        self._release()
        named = self._next_named()
        if named is None:
            torch.cuda.empty_cache()  # the buckets' blocks go back to the device before the KV-cache wake
            return self._summary()
        plan, buffers = flatten_bucket(named, self.version, self._index, device=self.device)
        del named
        # reduce_tensor records an event on the current stream: the receiver waits for the copies.
        handles = {d: reduce_tensor(b) for d, b in buffers.items()}
        self._in_flight = buffers
        self._count(plan)
        if self._uuid is None:
            self._uuid = device_uuid(self.device)
        return CudaIpcBucket(plan=encode_message(plan), handles={self._uuid: handles})

    def abort(self) -> None:
        super().abort()
        self._release()


class CudaIpcReceiver(ReceiverBase):
    """Generator side, on the same physical GPU as one of the senders (its CUDA index may differ).
    With `load_ipc` (an engine whose weights live in its own worker processes: vLLM) the checked
    message goes to the engine, whose workers open their own GPU's handles; otherwise this process
    opens the handle of its GPU and hands views to `load_weights`."""

    def __init__(self, load_weights: LoadWeights, expected: Expected | None = None,
                 device: torch.device | str | None = None,
                 load_ipc: Callable[[CudaIpcBucket], Awaitable[Any] | Any] | None = None):
        super().__init__(load_weights, expected, device)
        self._load_ipc = load_ipc

    async def receive(self, message: IpcMessage) -> int | None:
        import torch

        if isinstance(message, SyncSummary):
            return self._finish(message)
        if isinstance(message, SyncAbort):
            self._abort(message)
        try:
            plan = decode_message(message.plan)
            if not isinstance(plan, BucketPlan):
                raise WeightSyncError(f"CUDA IPC message holds a {type(plan).__name__}, not a bucket")
            self._check_plan(plan)
            if self._load_ipc is not None:
                await maybe_await(self._load_ipc(message))
                self._loaded(plan)
                return None
            prefer = torch.device(self.device).index if self.device is not None else None
            local_index, handles = select_ipc_handles(message, visible_cuda_uuids(), prefer)
            buffers = open_ipc_buffers(handles, local_index)
            await self._load(plan, unflatten_bucket(plan, buffers))
            # The ack (our return) lets the sender free the buffers: the copies must be done by then.
            torch.cuda.current_stream(local_index).synchronize()
            del buffers
        except BaseException:
            self._reset(None)
            raise
        return None


class LoadIpc(WorkerStep, frozen=True):
    """The merged bucket as bytes (ipc_message_to_bytes): this worker opens its own GPU's handles."""

    message: bytes

    def run(self, transport: CudaIpcTransport, worker: Any) -> int:
        return transport.load_ipc(worker, self.message)


class CudaIpcTransport(BucketedTransport):
    """Colocated on GPUs: every learner rank exports its own GPU's handles; merged per bucket. An engine
    that loads in its own workers (vLLM) gets the merged message as bytes; each worker opens its own
    GPU's handle (worker step ``LoadIpc``)."""

    key = TransportKey("cuda_ipc")
    worker_steps = (LoadIpc,)

    def make_sender(self, export_weights, bucket_mb, *, rank=0, device=None):
        return CudaIpcSender(lambda mb: export_weights(mb, device="cuda"), bucket_mb, device=device)

    def make_receiver(self, load_weights, engine=None):
        if engine is None:
            return CudaIpcReceiver(load_weights)

        async def load_ipc(message: CudaIpcBucket) -> None:
            count = len(decode_message(message.plan).tensors)
            await in_workers(engine, self.key, LoadIpc(ipc_message_to_bytes(message)), expect=count)

        return CudaIpcReceiver(load_weights, load_ipc=load_ipc)

    def merge_messages(self, messages):
        return merge_ipc_buckets(list(messages))

    def all_ranks_send(self) -> bool:
        return True

    def load_ipc(self, worker: Any, message: bytes) -> int:
        """This worker's own GPU's handles, views loaded, copies waited for; the tensors loaded."""
        plan = load_ipc_bucket(ipc_message_from_bytes(message), worker.arl_device(), worker.arl_load,
                               uuid=getattr(worker, "arl_uuid", None))
        return len(plan.tensors)


TRANSPORT = CudaIpcTransport()
