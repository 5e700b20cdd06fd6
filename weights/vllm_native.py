"""vLLM's own weight transfer (``vllm.distributed.weight_transfer``) behind our transport strategy.

vLLM (0.26 and later) builds a weight-transfer engine in each worker from the engine argument
``weight_transfer_config=WeightTransferConfig(backend=...)`` and drives it through four engine-client
calls: ``init_weight_transfer_engine`` once, then per sync ``start_weight_update``, one
``update_weights`` per chunk, ``finish_weight_update``. This module puts that protocol behind the
same sender/receiver halves as our transports (weights.protocol), so the coordinator drives it with
the same loop (``drive_bucketed_sync``) and the same counting (weights.base).

CUDA IPC (colocated): the sender shares the learner's exported tensors themselves, one IPC handle per
tensor keyed by the GPU's uuid (vLLM's ``IPCWeightTransferUpdateInfo``: names, dtype_names, shapes,
ipc_handles); no flat copy is made on our side (the difference from weights.ipc). A handle is what
vLLM 0.26's ``IPCWeightTransferEngine.receive_weights`` passes to ``rebuild_cuda_tensor`` after setting
its index 6 to the worker's device: the ARGUMENTS of torch's ``reduce_tensor`` (its second value), not
the (rebuild function, arguments) pair, which made 0.26's worker fail with "list assignment index out
of range" on the H200 (2026-12-04). Those arguments hold torch types (the tensor and storage classes,
the dtype), which vLLM's msgpack RPC to its engine core carries only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the vLLM engine sets it when it is built with a
``weight_transfer_config`` (actors/engines/vllm_engine.py). NCCL native is not wired: its trainer half
needs a group rank on the learner that our broadcast transport already owns, and config validation
refuses ``weight_sync_impl=vllm`` with nccl in one line.

Invariants:
- The sender keeps a chunk's tensors alive until its next ``next_bucket()``/``abort()``, which the
  coordinator makes only after every receiver returned from ``update_weights`` (vLLM's workers load
  synchronously inside it).
- Chunk 0 starts an update (``start_weight_update``) and the summary finishes it
  (``finish_weight_update``) before the counts are checked; an abort or any failure finishes the
  vLLM update too (best effort) and leaves the receiver's version where it was.
- ``VllmIpcChunk.plan`` describes the chunk exactly as a flat bucket would (offsets per dtype), so
  the receiver's checks against the engine's parameters are those of every other transport.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from weights.base import ReceiverBase, SenderBase, maybe_await
from weights.ipc import device_uuid
from weights.protocol import Transport, TransportKey
from weights.wire import (
    DTYPES, BucketPlan, ExportWeights, LoadWeights, NamedTensors, SyncAbort, SyncSummary, TensorMeta, WeightSyncError,
    dtype_name,
)

VLLM_BACKENDS = {"cuda_ipc": "ipc", "nccl": "nccl"}  # our weight_sync kind -> WeightTransferConfig.backend


def plan_of(named: NamedTensors, version: int, index: int) -> BucketPlan:
    """The plan a flat bucket of `named` would have, without flattening anything."""
    metas, numel = [], {}
    for name, tensor in named:
        d = dtype_name(tensor.dtype)
        metas.append(TensorMeta(name, tuple(tensor.shape), d, numel.get(d, 0)))
        numel[d] = numel.get(d, 0) + tensor.numel()
    return BucketPlan(version=version, index=index, tensors=metas,
                      buffer_nbytes={d: n * DTYPES[d].itemsize for d, n in numel.items()})


@dataclass
class VllmIpcChunk:
    """One chunk for vLLM's IPC engine: our plan (for the checks) and vLLM's update_info fields."""

    plan: BucketPlan
    handles: list[dict[str, Any]] = field(default_factory=list)  # per tensor: {gpu uuid: handle}

    def update_info(self) -> dict[str, Any]:
        return {"names": [m.name for m in self.plan.tensors],
                "dtype_names": [m.dtype for m in self.plan.tensors],
                "shapes": [list(m.shape) for m in self.plan.tensors],
                "ipc_handles": self.handles}


def merge_vllm_chunks(chunks: list[VllmIpcChunk]) -> VllmIpcChunk:
    """The learner ranks' chunks of one bucket (each its own GPU) -> one chunk, handles per tensor merged."""
    first = chunks[0]
    for other in chunks[1:]:
        if other.plan != first.plan:
            raise WeightSyncError(f"learner ranks disagree on weight sync v{first.plan.version} chunk "
                                  f"{first.plan.index}'s tensors")
    handles: list[dict[str, Any]] = [dict() for _ in first.handles]
    for chunk in chunks:
        for merged, h in zip(handles, chunk.handles):
            shared = set(merged) & set(h)
            if shared:
                raise WeightSyncError(f"two learner ranks export from the same GPU {sorted(shared)[0]}")
            merged.update(h)
    return VllmIpcChunk(plan=first.plan, handles=handles)


def ipc_args(tensor: torch.Tensor) -> tuple:
    """What vLLM's IPC engine takes per GPU: the arguments of torch's rebuild_cuda_tensor (index 6 is
    the device, which the worker overwrites with its own), without the rebuild function itself."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    return args


class VllmIpcSender(SenderBase):
    """Learner side: one handle per exported tensor. `share` (default `ipc_args`) and
    `uuid` are injectable so the control flow runs on CPU."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float, device: Any = None,
                 share: Callable[[torch.Tensor], Any] | None = None, uuid: str | None = None):
        super().__init__(export_weights, bucket_mb)
        self.device = device
        self._share = share
        self._uuid = uuid
        self._in_flight: NamedTensors | None = None

    def _release(self) -> None:
        if self._in_flight is not None:
            self._in_flight = None
            if torch.cuda.is_available() and self._share is None:
                torch.cuda.ipc_collect()

    def next_bucket(self) -> VllmIpcChunk | SyncSummary:
        self._release()
        named = self._next_named()
        if named is None:
            if torch.cuda.is_available() and self._share is None:
                torch.cuda.empty_cache()
            return self._summary()
        share = self._share or ipc_args
        if self._uuid is None:
            self._uuid = device_uuid(self.device if self.device is not None else torch.cuda.current_device())
        named = [(n, t.detach().contiguous()) for n, t in named]
        plan = plan_of(named, self.version, self._index)
        self._in_flight = named
        self._count(plan)
        return VllmIpcChunk(plan=plan, handles=[{self._uuid: share(t)} for _, t in named])

    def abort(self) -> None:
        super().abort()
        self._release()


class VllmNativeReceiver(ReceiverBase):
    """Generator side: drives the engine's vLLM weight-transfer client (start / update / finish).
    `client` has async (or plain) ``start_weight_update()``, ``update_weights(update_info: dict)``,
    ``finish_weight_update()`` (``VllmTransferClient`` over the engine's AsyncLLM)."""

    def __init__(self, load_weights: LoadWeights, client: Any):
        super().__init__(load_weights)
        self.client = client
        self._open = False

    async def _close(self) -> None:
        if self._open:
            self._open = False
            await maybe_await(self.client.finish_weight_update())

    async def receive(self, message: VllmIpcChunk | SyncSummary | SyncAbort) -> int | None:
        try:
            if isinstance(message, SyncSummary):
                await self._close()
                return self._finish(message)
            if isinstance(message, SyncAbort):
                self._abort(message)
            if not isinstance(message, VllmIpcChunk):
                raise WeightSyncError(f"vLLM weight transfer got a {type(message).__name__}, not a chunk")
            self._check_plan(message.plan)
            if message.plan.index == 0:
                await self._close()  # a previous, failed update is finished before a new one starts
                await maybe_await(self.client.start_weight_update())
                self._open = True
            await maybe_await(self.client.update_weights(message.update_info()))
            self._loaded(message.plan)
            return None
        except BaseException:
            self._reset(None)
            try:
                await self._close()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise


class VllmTransferClient:
    """vLLM's weight-transfer calls on the engine's AsyncLLM, as VllmNativeReceiver drives them: init
    (once, empty for CUDA IPC) before the first start, then start / update_weights(info) / finish."""

    def __init__(self, llm: Any):
        self.llm = llm
        self._ready = False

    @staticmethod
    def _request(name: str, **fields: Any) -> Any:
        from vllm.distributed.weight_transfer import base  # only where vLLM runs

        return getattr(base, name)(**fields)

    async def start_weight_update(self) -> None:
        if not self._ready:
            await self.llm.init_weight_transfer_engine(self._request("WeightTransferInitRequest", init_info={}))
            self._ready = True
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: dict) -> None:
        await self.llm.update_weights(self._request("WeightTransferUpdateRequest", update_info=update_info))

    async def finish_weight_update(self) -> None:
        await self.llm.finish_weight_update()


class VllmIpcTransport(Transport):
    key = TransportKey("cuda_ipc", "vllm")

    def make_sender(self, export_weights, bucket_mb, *, rank=0, device=None):
        return VllmIpcSender(lambda mb: export_weights(mb, device="cuda"), bucket_mb, device=device)

    def make_receiver(self, load_weights, engine=None):
        built = getattr(engine, "engine", engine)  # a DeferredEngine's built engine
        llm = getattr(built, "llm", None)
        if llm is None:
            raise WeightSyncError("coordinator.weight_sync_impl=vllm needs the vLLM engine (generator.engine=vllm)")
        return VllmNativeReceiver(load_weights, VllmTransferClient(llm))

    def merge_messages(self, messages):
        for message in messages:
            if isinstance(message, SyncAbort):
                return message
        if isinstance(messages[0], SyncSummary):
            return messages[0]
        return merge_vllm_chunks(list(messages))

    def all_ranks_send(self) -> bool:
        return True


TRANSPORT = VllmIpcTransport()
