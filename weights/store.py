"""Weight sync through the Ray object store: the CPU transport and the fallback everywhere.

Invariants:
- One bucket is one object: the encoded plan plus one uint8 numpy array per dtype (numpy travels
  zero-copy through the object store; bf16 has no numpy dtype, bytes do). The message handed to the
  receivers (``ObjectStoreBucket``) carries the reference in a list, so Ray passes it through actor
  calls unresolved and every receiver fetches the object itself.
- The sender puts bucket k+1 only when asked, i.e. after every receiver returned from bucket k
  (``drive_bucketed_sync``): at most one bucket is in the object store per sync.
- The receiver checks the announced (version, index) against the plan inside the object, and the
  plan against its parameters, before loading anything. An engine whose weights live in other
  processes (vLLM's workers) gets the plan and the raw buffers through ``load_flat`` (bytes with
  dtype and shape in the plan: never tensors through its RPC; the worker step ``LoadFlat``);
  otherwise ``load_weights`` gets views.
- Failure anywhere resets the receiver's in-flight sync; its version stays (weights.base).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

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
    payload_and_plan,
    payload_to_tensors,
    raw_bytes,
)

# (checked plan, {dtype: uint8 buffer, a numpy array or bytes}) -> loads the bucket in the engine's own workers
LoadFlatFn = Callable[[BucketPlan, dict[str, Any]], Any]


@dataclass
class ObjectStoreBucket:
    """One bucket in the Ray object store. `refs` is a list so that Ray passes the reference
    through actor calls instead of resolving it (the receiver fetches it itself)."""

    version: int
    index: int
    nbytes: int
    refs: list = field(default_factory=list)


class ObjectStoreSender(SenderBase):
    """Learner side. `put` defaults to ray.put (any callable works: tests pass the identity)."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float, put: Callable[[Any], Any] | None = None):
        super().__init__(export_weights, bucket_mb)
        self._put = put

    def next_bucket(self) -> ObjectStoreBucket | SyncSummary:
        """The next bucket, or the summary after the last. Call only once every receiver returned
        from the previous bucket (drive_bucketed_sync does)."""
        named = self._next_named()
        if named is None:
            return self._summary()
        payload, plan = payload_and_plan(named, self.version, self._index)
        del named  # the learner may free its gathered layer now; the flat copy is in `payload`
        put = self._put
        if put is None:
            import ray
            put = ray.put
        ref = put(payload)
        self._count(plan)
        return ObjectStoreBucket(version=plan.version, index=plan.index, nbytes=plan.nbytes, refs=[ref])


class ObjectStoreReceiver(ReceiverBase):
    """Generator side. `get` defaults to awaiting the Ray ObjectRef (async actors). With `load_flat`
    (an engine that loads in its own worker processes) the checked plan and the raw buffers go to it
    instead of views to `load_weights`."""

    def __init__(self, load_weights: LoadWeights, expected: Expected | None = None,
                 device: torch.device | str | None = None, get: Callable[[Any], Any] | None = None,
                 load_flat: LoadFlatFn | None = None):
        super().__init__(load_weights, expected, device)
        self._get = get
        self._load_flat = load_flat

    async def receive(self, message: ObjectStoreBucket | SyncSummary | SyncAbort) -> int | None:
        """Loads one bucket (returns None) or completes the sync (returns the new version)."""
        if isinstance(message, SyncSummary):
            return self._finish(message)
        if isinstance(message, SyncAbort):
            self._abort(message)
        try:
            ref = message.refs[0]
            payload = await maybe_await(self._get(ref) if self._get is not None else ref)
            if self._load_flat is not None:
                plan = decode_message(payload["plan"])
                if not isinstance(plan, BucketPlan):
                    raise WeightSyncError(f"object-store payload holds a {type(plan).__name__}, not a bucket")
            else:
                plan, named = payload_to_tensors(payload, None, self.device)
            if (plan.version, plan.index) != (message.version, message.index):
                raise WeightSyncError(
                    f"object-store bucket announced as v{message.version}/{message.index} holds v{plan.version}/{plan.index}")
            self._check_plan(plan)
            if self._load_flat is not None:
                await maybe_await(self._load_flat(plan, dict(payload["buffers"])))
                self._loaded(plan)
            else:
                await self._load(plan, named)
        except BaseException:
            self._reset(None)
            raise
        return None


class LoadFlat(WorkerStep, frozen=True):
    """A checked plan (encoded) and its raw buffers, rebuilt on the worker's device from dtype and shape."""

    plan: bytes
    buffers: dict[str, bytes]

    def run(self, transport: ObjectStoreTransport, worker: Any) -> int:
        return transport.load_flat(worker, self.plan, self.buffers)


async def load_in_workers(engine: Any, plan: BucketPlan, buffers: dict[str, Any]) -> None:
    """One checked bucket into every worker of an engine that loads in its own workers (vLLM): the
    plan and the raw bytes of each dtype's buffer; every worker must load all of its tensors."""
    raw = {d: raw_bytes(b) for d, b in buffers.items()}
    await in_workers(engine, TRANSPORT.key, LoadFlat(plan=encode_message(plan), buffers=raw), expect=len(plan.tensors))


class ObjectStoreTransport(BucketedTransport):
    """The CPU transport and the one the transformers engine always takes. An engine that loads in
    its own workers (vLLM) gets each checked plan and its raw buffers there (worker step ``LoadFlat``)."""

    key = TransportKey("object_store")
    worker_steps = (LoadFlat,)

    def make_sender(self, export_weights, bucket_mb, *, rank=0, device=None):
        return ObjectStoreSender(export_weights, bucket_mb)

    def make_receiver(self, load_weights, engine=None):
        if engine is None:
            return ObjectStoreReceiver(load_weights)
        return ObjectStoreReceiver(load_weights, load_flat=lambda plan, buffers: load_in_workers(engine, plan, buffers))

    def load_flat(self, worker: Any, plan: bytes, buffers: dict[str, bytes]) -> int:
        _, named = payload_to_tensors({"plan": plan, "buffers": buffers}, None, worker.arl_device())
        worker.arl_load(named)
        return len(named)


TRANSPORT = ObjectStoreTransport()
