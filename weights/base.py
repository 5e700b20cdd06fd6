"""Weight-sync bookkeeping both ends share, whatever the transport.

Invariants:
- After a receiver's sync for version v completes (``receive(SyncSummary)`` / ``receive_all``
  returns v), every tensor the sender exported for v was handed to the engine (``load_weights``,
  or the engine's in-worker loader) bit for bit: same name, shape, dtype and bytes.
- A partial sync never bumps the version: a missing or extra bucket, a count mismatch, a header
  that disagrees with the receiver's parameters, a failed load or an abort raise
  ``WeightSyncError`` and ``receiver.version`` stays at the last complete sync. (The engine may
  already hold some new tensors then: the generator must not publish samples under the new
  version, and the coordinator should retry the sync or restart the generator.)
- Bucket 0 always opens a new sync, even after a failed one; buckets arrive in index order and
  no tensor name twice within one sync.
- The sender holds at most ~2 buckets: the learner's current bucket plus its flat copy. It pulls
  the next bucket from ``export_weights`` only after the previous one was released (object store:
  the coordinator asked for the next one; CUDA IPC: every receiver acked; broadcast: it finished).
- ``drive_bucketed_sync`` (the coordinator's loop for the per-bucket transports) has at most one
  bucket in flight and calls ``abort`` on any failure.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    import torch

from weights.wire import (
    BucketPlan,
    Expected,
    ExportWeights,
    LoadWeights,
    NamedTensors,
    SyncAbort,
    SyncSummary,
    WeightSyncError,
    normalise_expected,
    validate_plan,
)


class SenderBase:
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


class ExportOnly:
    """A learner rank that only takes part: runs the export (its ZeRO-3 gathers are collective, so every
    rank iterates in lockstep) and drops what it yields; rank 0's sender moves the weights."""

    def __init__(self, export_weights: ExportWeights, bucket_mb: float):
        self.export_weights, self.bucket_mb, self._buckets = export_weights, bucket_mb, None

    def start(self, version: int) -> None:
        self._buckets = iter(self.export_weights(self.bucket_mb))

    def next_bucket(self) -> None:
        next(self._buckets, None)

    def run(self) -> None:
        """The whole export at once (beside a collective sender's send)."""
        for _ in self.export_weights(self.bucket_mb):
            pass

    def abort(self) -> None:
        if self._buckets is not None and hasattr(self._buckets, "close"):
            self._buckets.close()
        self._buckets = None


class ReceiverBase:
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
        self._loaded(plan)

    def _loaded(self, plan: BucketPlan) -> None:
        """Counts a bucket the engine took (by `load_weights` or by its own in-worker loader)."""
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


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def drive_bucketed_sync(next_message: Callable[[], Any], receivers: Sequence[Callable[[Any], Any]],
                              abort: Callable[[], Any] | None = None) -> int:
    """The coordinator's loop for the per-bucket transports (object store, CUDA IPC).

    Asks the sender for one message, hands it to every receiver concurrently, and asks for the
    next only once all of them returned: that return is the ack that lets the sender release the
    bucket, so at most one bucket is in flight. Returns the version once every receiver finished.
    ``weights.protocol.Transport.sync`` runs it with the learner's and the generators' verbs
    (next -> ``sender.next_bucket()``, receive -> ``receiver.receive(message)``, abort ->
    ``sender.abort()``), after a start -> ``sender.start(version)``. On any error, calls `abort` (releases the sender's buffers) and re-raises; receivers keep
    their previous version and reset on the next sync's bucket 0.
    """
    try:
        while True:
            message = await maybe_await(next_message())
            results = await asyncio.gather(*(maybe_await(receive(message)) for receive in receivers))
            if isinstance(message, SyncSummary):
                if any(r != message.version for r in results):
                    raise WeightSyncError(f"weight sync v{message.version}: receivers returned {results}")
                return message.version
    except BaseException:
        if abort is not None:
            await maybe_await(abort())
        raise
