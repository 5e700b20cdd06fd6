"""Weight-sync wire format: how one bucket of named tensors travels, whatever the transport.

Invariants:
- A bucket is one contiguous uint8 buffer per dtype plus a ``BucketPlan`` header (msgspec,
  msgpack) listing each tensor's name, shape, dtype and element offset into its dtype's buffer,
  the version and the bucket's index within the sync. A bucket therefore costs one object, one
  IPC handle or one broadcast per dtype, never one per tensor.
- ``flatten_bucket`` copies into fresh buffers (the sender may free its tensors right after);
  ``unflatten_bucket`` returns views in the plan's order and never copies.
- ``unflatten_bucket(flatten_bucket(x))`` is bit-exact: same names, shapes, dtypes and bytes
  (NaN payloads and -0.0 included); only the dtypes in ``DTYPES`` travel, anything else is
  refused by name instead of being misread.
- ``validate_plan`` refuses, before any byte is copied, a header that is inconsistent (offsets past
  a buffer, bytes its tensors do not cover, unknown dtype, negative shape) or that disagrees with the
  receiver's parameters; every error is one ``WeightSyncError`` line naming the version, the bucket,
  the tensor and both sides.
- Every message carries ``schema``; a message of another schema is refused, never guessed at.
- Pure: no Ray, no CUDA, no torch.distributed here (the transports live in weights.store,
  weights.ipc and weights.broadcast; weights.base holds the counting both ends share).
- Importing it imports no torch (the coordinator drives syncs with the messages alone and never
  holds a tensor): the functions that touch tensors import torch when called, and ``DTYPES`` is
  built on first use.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

WEIGHT_SYNC_SCHEMA = 1
MB = 1 << 20

# The dtypes that may travel; anything else is refused by name instead of being misread.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool", "float8_e4m3fn", "float8_e5m2")


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """DTYPES: name -> torch dtype, of the DTYPE_NAMES this torch has (torch imported here)."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # `from weights.wire import DTYPES` imports torch then, not this module
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


NamedTensors = list[tuple[str, "torch.Tensor"]]
ExportWeights = Callable[[int], Iterable[NamedTensors]]  # learner.export_weights(bucket_mb)
LoadWeights = Callable[[Iterable[tuple[str, "torch.Tensor"]], int], Any]  # engine.load_weights
# name -> (shape, dtype): what the receiver's model holds; optional
Expected = Mapping[str, tuple[Sequence[int], Union["torch.dtype", str]]]


class WeightSyncError(RuntimeError):
    """A sync that could not complete; the receiver's version was not bumped."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in torch_dtypes():
        raise WeightSyncError(f"dtype {dtype} cannot travel in a weight sync (known: {sorted(torch_dtypes())})")
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
    import torch

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
        flat = torch.empty(numel[dname], dtype=torch_dtypes()[dname], device=target)
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
    dtypes = torch_dtypes()
    for meta in plan.tensors:
        if meta.dtype not in dtypes:
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
        itemsize = dtypes[meta.dtype].itemsize
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
    import torch

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
        dtype = torch_dtypes()[dname]
        typed[dname] = buf.view(dtype) if buf.numel() else buf.new_empty(0, dtype=dtype)
    return [(m.name, typed[m.dtype][m.offset:m.offset + m.numel].view(m.shape)) for m in plan.tensors]


def bucket_to_payload(named: NamedTensors, version: int, index: int) -> dict[str, Any]:
    """A bucket as what ray.put stores well: the encoded plan plus one uint8 numpy array per dtype
    (numpy travels zero-copy through the object store; bf16 has no numpy dtype, bytes do)."""
    return payload_and_plan(named, version, index)[0]


def payload_and_plan(named: NamedTensors, version: int, index: int) -> tuple[dict[str, Any], BucketPlan]:
    plan, buffers = flatten_bucket(named, version, index, device="cpu")
    return {"plan": encode_message(plan), "buffers": {d: b.numpy() for d, b in buffers.items()}}, plan


def _as_uint8(data: Any) -> np.ndarray:
    """A numpy uint8 array (the object store's form) or raw bytes (what an engine RPC carries)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.asarray(data, dtype=np.uint8)


def raw_bytes(buffer: Any) -> bytes:
    """A flat uint8 buffer (numpy array, CPU tensor or bytes) as bytes an engine's RPC (msgpack) carries."""
    if isinstance(buffer, bytes):
        return buffer
    if hasattr(buffer, "numpy"):
        buffer = buffer.numpy()
    return memoryview(buffer).cast("B").tobytes()


def payload_to_tensors(payload: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                       device: torch.device | str | None = None) -> tuple[BucketPlan, NamedTensors]:
    """Inverse of bucket_to_payload: checks the plan, then views (or one copy per dtype to `device`).
    A buffer may also be raw bytes: the plain form an engine's RPC can carry (vLLM's msgpack)."""
    import torch

    plan = decode_message(payload["plan"])
    if not isinstance(plan, BucketPlan):
        raise WeightSyncError(f"object-store payload holds a {type(plan).__name__}, not a bucket")
    validate_plan(plan, expected)
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; load_weights copies out of them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        buffers = {d: torch.from_numpy(_as_uint8(a)) for d, a in payload["buffers"].items()}
    if device is not None:
        buffers = {d: b.to(device, non_blocking=True) for d, b in buffers.items()}
    return plan, unflatten_bucket(plan, buffers)
