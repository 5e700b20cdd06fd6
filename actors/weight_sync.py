"""Weight sync: the learner's weights into every generator's engine, one bounded bucket at a time.

Invariants:
- After a receiver's sync for version v completes (``receive(SyncSummary)`` / ``receive_all``
  returns v), every tensor the sender exported for v was handed to the engine's
  ``load_weights(named_tensors, v)`` bit for bit (same name, shape, dtype and bytes).
- A partial sync never bumps the version: a missing or extra bucket, a count mismatch, a header
  that disagrees with the receiver's parameters, a failed load or an abort raise
  ``WeightSyncError`` and ``receiver.version`` stays at the last complete sync. (The engine may
  already hold some new tensors then: the generator must not publish samples under the new
  version, and the coordinator should retry the sync or restart the generator.)
- The sender holds at most ~2 buckets: the learner's current bucket plus its flat copy. It
  pulls the next bucket from ``export_weights`` only after the previous one was released
  (object store: the coordinator asked for the next one; CUDA IPC: every receiver acked; NCCL /
  gloo: the broadcast finished).
- Nothing here touches ``torch.distributed``'s default process group: the NCCL/gloo transport
  builds its own group from its own TCPStore, so the learner's DeepSpeed group is left alone.

Wire format, shared by every transport: a bucket is one contiguous uint8 buffer per dtype (so a
bucket costs one object, one IPC handle or one broadcast per dtype, not one per tensor) plus a
``BucketPlan`` header (msgspec, msgpack) listing each tensor's name, shape, dtype and element
offset into its dtype's buffer, and the version. The receiver allocates from the plan, checks it
against its own parameters when it knows them (``expected``), and rebuilds views.

Transports (pick with ``CoordinatorConfig.weight_sync``):
- ``ObjectStoreSender`` / ``ObjectStoreReceiver``: the Ray object store. CPU and the fallback.
- ``CudaIpcSender`` / ``CudaIpcReceiver``: same physical GPU, CUDA IPC handles, zero copy over
  the wire (the receiver copies straight from the learner's buffer into its parameters).
- ``BroadcastSender`` / ``BroadcastReceiver``: a private NCCL (GPU) or gloo (CPU) group with the
  learner as rank 0 and one rank per generator process.
See each class and ``drive_bucketed_sync`` for the exact calls the coordinator makes.
"""
from __future__ import annotations

import asyncio
import datetime
import inspect
import math
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence, Union

import msgspec
import numpy as np
import torch

WEIGHT_SYNC_SCHEMA = 1
MB = 1 << 20

# The dtypes that may travel; anything else is refused by name instead of being misread.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
        "uint8", "bool", "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}

NamedTensors = list[tuple[str, torch.Tensor]]
ExportWeights = Callable[[int], Iterable[NamedTensors]]  # learner.export_weights(bucket_mb)
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]], int], Any]  # engine.load_weights
# name -> (shape, dtype): what the receiver's model holds; optional
Expected = Mapping[str, tuple[Sequence[int], Union[torch.dtype, str]]]


class WeightSyncError(RuntimeError):
    """A sync that could not complete; the receiver's version was not bumped."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WeightSyncError(f"dtype {dtype} cannot travel in a weight sync (known: {sorted(DTYPES)})")
    return name


# ----------------------------------------------------------------------------- messages


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    name: str
    shape: tuple[int, ...]
    dtype: str  # a key of DTYPES
    offset: int  # in elements, into this dtype's buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class BucketPlan(msgspec.Struct, tag="bucket", kw_only=True):
    """Everything a receiver needs to allocate, check and unflatten one bucket."""

    schema: int = WEIGHT_SYNC_SCHEMA
    version: int
    index: int  # 0, 1, 2, ... within one sync
    tensors: list[TensorMeta]
    buffer_nbytes: dict[str, int]  # dtype -> bytes of that dtype's flat buffer

    @property
    def nbytes(self) -> int:
        return sum(self.buffer_nbytes.values())


class SyncSummary(msgspec.Struct, tag="done", kw_only=True):
    """The sender's last message: what a complete sync for `version` consisted of."""

    schema: int = WEIGHT_SYNC_SCHEMA
    version: int
    num_buckets: int
    num_tensors: int
    nbytes: int


class SyncAbort(msgspec.Struct, tag="abort", kw_only=True):
    schema: int = WEIGHT_SYNC_SCHEMA
    version: int
    reason: str


SyncMessage = Union[BucketPlan, SyncSummary, SyncAbort]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SyncMessage)


def encode_message(message: SyncMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(data: bytes) -> SyncMessage:
    try:
        message = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise WeightSyncError(f"malformed weight-sync message: {exc}") from None
    if message.schema != WEIGHT_SYNC_SCHEMA:
        raise WeightSyncError(
            f"weight-sync message schema {message.schema}, this code speaks {WEIGHT_SYNC_SCHEMA}")
    return message


# ----------------------------------------------------------------------------- pure pieces


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float) -> Iterator[NamedTensors]:
    """Groups a flat stream of named tensors into buckets of at most `bucket_mb` MiB.

    A tensor larger than the bound travels alone in its own bucket. This is the bucketing the
    learner's `export_weights(bucket_mb)` is expected to do; tests and benches use it directly.
    """
    limit = int(bucket_mb * MB)
    if limit <= 0:
        raise WeightSyncError(f"bucket_mb must be > 0, got {bucket_mb}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(named: NamedTensors, version: int, index: int,
                   device: torch.device | str | None = None) -> tuple[BucketPlan, dict[str, torch.Tensor]]:
    """One contiguous buffer per dtype (returned as uint8 views) plus the plan that undoes it.

    The buffers are fresh allocations on `device` (default: each dtype's first tensor's device),
    so they stay valid after the learner frees its gathered parameters.
    """
    if not named:
        raise WeightSyncError(f"bucket {index} of version {version} is empty")
    metas: list[TensorMeta] = []
    groups: dict[str, list[torch.Tensor]] = {}
    numel: dict[str, int] = {}
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise WeightSyncError(f"tensor {name!r} appears twice in bucket {index}")
        seen.add(name)
        dname = dtype_name(tensor.dtype)
        metas.append(TensorMeta(name, tuple(tensor.shape), dname, numel.get(dname, 0)))
        groups.setdefault(dname, []).append(tensor)
        numel[dname] = numel.get(dname, 0) + tensor.numel()
    buffers: dict[str, torch.Tensor] = {}
    for dname, tensors in groups.items():
        target = torch.device(device) if device is not None else tensors[0].device
        # Copy into one preallocated buffer: no per-tensor intermediates, so the peak is one bucket.
        flat = torch.empty(numel[dname], dtype=DTYPES[dname], device=target)
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            flat[offset:offset + n].copy_(tensor.detach().reshape(-1))
            offset += n
        buffers[dname] = flat.view(torch.uint8)
    plan = BucketPlan(version=version, index=index, tensors=metas,
                      buffer_nbytes={d: b.numel() for d, b in buffers.items()})
    return plan, buffers


def normalise_expected(expected: Expected | None) -> dict[str, tuple[tuple[int, ...], str]] | None:
    if expected is None:
        return None
    out = {}
    for name, (shape, dtype) in expected.items():
        out[name] = (tuple(int(s) for s in shape), dtype if isinstance(dtype, str) else dtype_name(dtype))
    return out


def expected_from_named(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """`expected` for a receiver, from its model's `named_parameters()` / `state_dict().items()`."""
    return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in named_tensors}


def validate_plan(plan: BucketPlan, expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Refuses a header that is inconsistent or disagrees with the receiver's parameters.

    Raises WeightSyncError naming the bucket, the tensor and both sides of the mismatch.
    """
    where = f"weight sync v{plan.version} bucket {plan.index}"
    used: dict[str, int] = {}
    for meta in plan.tensors:
        if meta.dtype not in DTYPES:
            raise WeightSyncError(f"{where}: tensor {meta.name!r} has unknown dtype {meta.dtype!r}")
        if any(s < 0 for s in meta.shape):
            raise WeightSyncError(f"{where}: tensor {meta.name!r} has negative shape {meta.shape}")
        if expected is not None:
            if meta.name not in expected:
                raise WeightSyncError(f"{where}: tensor {meta.name!r} is not a parameter of this model")
            want_shape, want_dtype = expected[meta.name]
            if meta.shape != want_shape or meta.dtype != want_dtype:
                raise WeightSyncError(
                    f"{where}: tensor {meta.name!r} arrives as shape {list(meta.shape)} {meta.dtype}, "
                    f"the model holds shape {list(want_shape)} {want_dtype}")
        itemsize = DTYPES[meta.dtype].itemsize
        end = (meta.offset + meta.numel) * itemsize
        if meta.offset < 0 or end > plan.buffer_nbytes.get(meta.dtype, -1):
            raise WeightSyncError(
                f"{where}: tensor {meta.name!r} ({meta.dtype}, offset {meta.offset}, {meta.numel} elements) "
                f"runs past its {plan.buffer_nbytes.get(meta.dtype, 0)}-byte buffer")
        used[meta.dtype] = used.get(meta.dtype, 0) + meta.numel * itemsize
    for dname, nbytes in plan.buffer_nbytes.items():
        if used.get(dname, 0) != nbytes:
            raise WeightSyncError(f"{where}: {dname} buffer has {nbytes} bytes but its tensors cover {used.get(dname, 0)}")


def unflatten_bucket(plan: BucketPlan, buffers: Mapping[str, torch.Tensor]) -> NamedTensors:
    """Views into `buffers` (uint8, one per dtype), in the plan's order. No copies."""
    where = f"weight sync v{plan.version} bucket {plan.index}"
    if set(buffers) != set(plan.buffer_nbytes):
        raise WeightSyncError(f"{where}: buffers for {sorted(buffers)}, plan lists {sorted(plan.buffer_nbytes)}")
    typed = {}
    for dname, buf in buffers.items():
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != plan.buffer_nbytes[dname]:
            raise WeightSyncError(
                f"{where}: {dname} buffer is {buf.dtype} of {tuple(buf.shape)}, "
                f"the plan wants {plan.buffer_nbytes[dname]} uint8 bytes")
        # numpy hands back empty arrays with stride 0, which view(dtype) refuses
        typed[dname] = buf.view(DTYPES[dname]) if buf.numel() else buf.new_empty(0, dtype=DTYPES[dname])
    return [(m.name, typed[m.dtype][m.offset:m.offset + m.numel].view(m.shape)) for m in plan.tensors]


def bucket_to_payload(named: NamedTensors, version: int, index: int) -> dict[str, Any]:
    """A bucket as what ray.put stores well: the encoded plan plus one uint8 numpy array per dtype
    (numpy travels zero-copy through the object store; bf16 has no numpy dtype, bytes do)."""
    return _payload_and_plan(named, version, index)[0]


def _payload_and_plan(named: NamedTensors, version: int, index: int) -> tuple[dict[str, Any], BucketPlan]:
    plan, buffers = flatten_bucket(named, version, index, device="cpu")
    return {"plan": encode_message(plan), "buffers": {d: b.numpy() for d, b in buffers.items()}}, plan


def payload_to_tensors(payload: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                       device: torch.device | str | None = None) -> tuple[BucketPlan, NamedTensors]:
    """Inverse of bucket_to_payload: checks the plan, then views (or one copy per dtype to `device`)."""
    plan = decode_message(payload["plan"])
    if not isinstance(plan, BucketPlan):
        raise WeightSyncError(f"object-store payload holds a {type(plan).__name__}, not a bucket")
    validate_plan(plan, expected)
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; load_weights copies out of them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        buffers = {d: torch.from_numpy(np.asarray(a, dtype=np.uint8)) for d, a in payload["buffers"].items()}
    if device is not None:
        buffers = {d: b.to(device, non_blocking=True) for d, b in buffers.items()}
    return plan, unflatten_bucket(plan, buffers)


# ----------------------------------------------------------------------------- bookkeeping


class _SenderBase:
    """Pulls buckets from the learner's export_weights lazily, so at most one is live."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float):
        if bucket_mb <= 0:
            raise WeightSyncError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.export_weights = export_weights
        self.bucket_mb = bucket_mb
        self._buckets: Iterator[NamedTensors] | None = None
        self.version: int | None = None
        self._index = 0
        self._num_tensors = 0
        self._nbytes = 0

    def start(self, version: int) -> None:
        if self._buckets is not None:
            raise WeightSyncError(f"weight sync v{self.version} is still in progress; abort() it first")
        self.version = version
        self._buckets = iter(self.export_weights(self.bucket_mb))
        self._index = self._num_tensors = self._nbytes = 0

    def _next_named(self) -> NamedTensors | None:
        if self._buckets is None:
            raise WeightSyncError("weight sync not started: call start(version) first")
        return next(self._buckets, None)

    def _count(self, plan: BucketPlan) -> None:
        self._index += 1
        self._num_tensors += len(plan.tensors)
        self._nbytes += plan.nbytes

    def _summary(self) -> SyncSummary:
        summary = SyncSummary(version=self.version, num_buckets=self._index,
                              num_tensors=self._num_tensors, nbytes=self._nbytes)
        self._buckets = None  # closes the export generator's frame on the next GC
        return summary

    def abort(self) -> None:
        """Drops the export iterator (and any held buffers); safe to call at any time."""
        if self._buckets is not None and hasattr(self._buckets, "close"):
            self._buckets.close()
        self._buckets = None


class _ReceiverBase:
    """Counts what arrived for the version in flight and bumps `version` only when it is whole."""

    def __init__(self, load_weights: LoadWeights, expected: Expected | None = None,
                 device: torch.device | str | None = None):
        self.load_weights = load_weights
        self.expected = normalise_expected(expected)
        self.device = device
        self.version: int | None = None  # the last complete sync
        self._reset(None)

    def _reset(self, version: int | None) -> None:
        self._incoming: int | None = version
        self._next_index = 0
        self._num_tensors = 0
        self._nbytes = 0
        self._names: set[str] = set()

    def _check_plan(self, plan: BucketPlan) -> None:
        if plan.index == 0:  # bucket 0 always opens a new sync, even after a failed one
            self._reset(plan.version)
        where = f"weight sync v{plan.version} bucket {plan.index}"
        if plan.version != self._incoming:
            raise WeightSyncError(f"{where} arrived while v{self._incoming} is in progress")
        if plan.index != self._next_index:
            raise WeightSyncError(f"{where} arrived, bucket {self._next_index} was expected next")
        validate_plan(plan, self.expected)
        for meta in plan.tensors:
            if meta.name in self._names:
                raise WeightSyncError(f"{where}: tensor {meta.name!r} was already received in this sync")

    async def _load(self, plan: BucketPlan, named: NamedTensors) -> None:
        result = self.load_weights(named, plan.version)
        if inspect.isawaitable(result):
            await result
        self._next_index += 1
        self._num_tensors += len(plan.tensors)
        self._nbytes += plan.nbytes
        self._names.update(m.name for m in plan.tensors)

    def _finish(self, summary: SyncSummary) -> int:
        got = (self._next_index, self._num_tensors, self._nbytes)
        want = (summary.num_buckets, summary.num_tensors, summary.nbytes)
        incoming, names = self._incoming, self._names
        self._reset(None)  # whatever happens below, the next sync starts clean
        if incoming is not None and incoming != summary.version:
            raise WeightSyncError(f"weight sync v{summary.version} finished while v{incoming} was in progress")
        if got != want:
            raise WeightSyncError(
                f"weight sync v{summary.version} incomplete: got (buckets, tensors, bytes) {got}, sender sent {want}")
        if self.expected is not None:
            missing = sorted(set(self.expected) - names)
            if missing:
                raise WeightSyncError(
                    f"weight sync v{summary.version} left {len(missing)} parameters unset, e.g. {missing[:5]}")
        self.version = summary.version
        return summary.version

    def _abort(self, message: SyncAbort) -> None:
        self._reset(None)
        raise WeightSyncError(f"weight sync v{message.version} aborted by the sender: {message.reason}")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def drive_bucketed_sync(next_message: Callable[[], Any], receivers: Sequence[Callable[[Any], Any]],
                              abort: Callable[[], Any] | None = None) -> int:
    """The coordinator's loop for the per-bucket transports (object store, CUDA IPC).

    Asks the sender for one message, hands it to every receiver concurrently, and asks for the
    next only once all of them returned: that return is the ack that lets the sender release the
    bucket, so at most one bucket is in flight. Returns the version once every receiver finished.
    With Ray actors:

        version = await drive_bucketed_sync(
            learner.weight_sync_next.remote,                      # -> ObjectStoreSender.next_bucket()
            [g.weight_sync_receive.remote for g in generators],   # -> ObjectStoreReceiver.receive(msg)
            abort=learner.weight_sync_abort.remote)               # -> sender.abort()

    (call `learner.weight_sync_start.remote(version)` -> `sender.start(version)` first).
    On any error, calls `abort` (releases the sender's buffers) and re-raises; receivers keep
    their previous version and reset on the next sync's bucket 0.
    """
    try:
        while True:
            message = await _maybe_await(next_message())
            results = await asyncio.gather(*(_maybe_await(receive(message)) for receive in receivers))
            if isinstance(message, SyncSummary):
                if any(r != message.version for r in results):
                    raise WeightSyncError(f"weight sync v{message.version}: receivers returned {results}")
                return message.version
    except BaseException:
        if abort is not None:
            await _maybe_await(abort())
        raise


# ----------------------------------------------------------------------------- object store


@dataclass
class ObjectStoreBucket:
    """One bucket in the Ray object store. `refs` is a list so that Ray passes the reference
    through actor calls instead of resolving it (the receiver fetches it itself)."""

    version: int
    index: int
    nbytes: int
    refs: list = field(default_factory=list)


class ObjectStoreSender(_SenderBase):
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
        payload, plan = _payload_and_plan(named, self.version, self._index)
        del named  # the learner may free its gathered layer now; the flat copy is in `payload`
        put = self._put
        if put is None:
            import ray
            put = ray.put
        ref = put(payload)
        self._count(plan)
        return ObjectStoreBucket(version=plan.version, index=plan.index, nbytes=plan.nbytes, refs=[ref])


class ObjectStoreReceiver(_ReceiverBase):
    """Generator side. `get` defaults to awaiting the Ray ObjectRef (async actors)."""

    def __init__(self, load_weights: LoadWeights, expected: Expected | None = None,
                 device: torch.device | str | None = None, get: Callable[[Any], Any] | None = None):
        super().__init__(load_weights, expected, device)
        self._get = get

    async def receive(self, message: ObjectStoreBucket | SyncSummary | SyncAbort) -> int | None:
        """Loads one bucket (returns None) or completes the sync (returns the new version)."""
        if isinstance(message, SyncSummary):
            return self._finish(message)
        if isinstance(message, SyncAbort):
            self._abort(message)
        try:
            ref = message.refs[0]
            payload = await _maybe_await(self._get(ref) if self._get is not None else ref)
            plan, named = payload_to_tensors(payload, None, self.device)
            if (plan.version, plan.index) != (message.version, message.index):
                raise WeightSyncError(
                    f"object-store bucket announced as v{message.version}/{message.index} holds v{plan.version}/{plan.index}")
            self._check_plan(plan)
            await self._load(plan, named)
        except BaseException:
            self._reset(None)
            raise
        return None


# ----------------------------------------------------------------------------- CUDA IPC


@dataclass
class CudaIpcBucket:
    """One bucket as CUDA IPC handles into the learner's flat buffers (same physical GPU)."""

    plan: bytes
    handles: dict[str, tuple]  # dtype -> torch.multiprocessing.reductions.reduce_tensor(buffer)
    device_uuid: str


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIpcSender(_SenderBase):
    """Learner side. Each bucket is flattened into fresh buffers on `device`; their handles go out
    and the buffers stay alive until the next `next_bucket()`/`abort()` call, which the
    coordinator makes only after every receiver acked (returned from `receive`)."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float, device: torch.device | str | None = None):
        super().__init__(export_weights, bucket_mb)
        self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        self._in_flight: dict[str, torch.Tensor] | None = None

    def _release(self) -> None:
        if self._in_flight is not None:
            self._in_flight = None
            torch.cuda.ipc_collect()  # frees blocks whose IPC ref counts the receivers dropped

    def next_bucket(self) -> CudaIpcBucket | SyncSummary:
        from torch.multiprocessing.reductions import reduce_tensor

        self._release()
        named = self._next_named()
        if named is None:
            return self._summary()
        plan, buffers = flatten_bucket(named, self.version, self._index, device=self.device)
        del named
        # reduce_tensor records an event on the current stream: the receiver waits for the copies.
        handles = {d: reduce_tensor(b) for d, b in buffers.items()}
        self._in_flight = buffers
        self._count(plan)
        return CudaIpcBucket(plan=encode_message(plan), handles=handles, device_uuid=_device_uuid(self.device))

    def abort(self) -> None:
        super().abort()
        self._release()


class CudaIpcReceiver(_ReceiverBase):
    """Generator side, on the same physical GPU as the learner (its CUDA index may differ)."""

    async def receive(self, message: CudaIpcBucket | SyncSummary | SyncAbort) -> int | None:
        if isinstance(message, SyncSummary):
            return self._finish(message)
        if isinstance(message, SyncAbort):
            self._abort(message)
        try:
            plan = decode_message(message.plan)
            if not isinstance(plan, BucketPlan):
                raise WeightSyncError(f"CUDA IPC message holds a {type(plan).__name__}, not a bucket")
            self._check_plan(plan)
            local_index = self._local_index(message.device_uuid)
            buffers = {}
            for dname, (rebuild, args) in message.handles.items():
                args = list(args)
                args[6] = local_index  # rebuild_cuda_tensor's storage_device: the sender's index, not ours
                buffers[dname] = rebuild(*args)
            await self._load(plan, unflatten_bucket(plan, buffers))
            # The ack (our return) lets the sender free the buffers: the copies must be done by then.
            torch.cuda.current_stream(local_index).synchronize()
            del buffers
        except BaseException:
            self._reset(None)
            raise
        return None

    @staticmethod
    def _local_index(uuid: str) -> int:
        for index in range(torch.cuda.device_count()):
            if _device_uuid(torch.device("cuda", index)) == uuid:
                return index
        raise WeightSyncError(
            f"CUDA IPC weight sync needs the learner's GPU {uuid} to be visible here; use nccl across GPUs")


# ----------------------------------------------------------------------------- NCCL / gloo broadcast


@dataclass(frozen=True)
class Rendezvous:
    """Where the private weight-sync group meets; the learner makes it, the coordinator passes it on."""

    host: str
    port: int
    world_size: int  # 1 (the learner) + one rank per receiving generator process
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


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


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
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        context = torch.cuda.device(device) if device.type == "cuda" else _nullcontext()
        with context:  # this may run on a worker thread, whose current CUDA device is 0
            for dname, nbytes in plan.buffer_nbytes.items():  # the plan's order, identical on every rank
                if nbytes:  # gloo never completes a zero-byte broadcast
                    self._group.broadcast([buffers[dname]], options).wait()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class BroadcastSender(_SenderBase, _Broadcaster):
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
        import torch.distributed as dist

        if world_size < 2:
            raise WeightSyncError(f"a weight-sync group needs the learner and >= 1 generator, world_size={world_size}")
        host = host or node_ip()
        # torch's TCPStore server would listen on every interface: it is handed a socket bound to
        # this node's address alone (127.0.0.1 in a local run), on a free port; the store owns it.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(max(128, world_size))
        except OSError as e:
            listener.close()
            raise WeightSyncError(f"weight sync: cannot listen on {host}: {e}") from None
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(host, port, world_size, is_master=True, timeout=self.timeout,
                                    wait_for_workers=False, master_listen_fd=listener.detach())
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


class BroadcastReceiver(_ReceiverBase, _Broadcaster):
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
