"""The per-bucket protocol the object store and CUDA IPC share: its four steps and its coordinator loop.

Sender steps (a learner rank): ``Start(version, bucket_mb)`` -> ``start``, ``Next()`` -> ``next_bucket``
(one message: a bucket, or the summary after the last), ``Abort()`` -> ``abort``; receiver step (a
generator): ``Receive(message)`` -> ``receive``. A transport built on it (``BucketedTransport``) says
only how a bucket travels: its sender and receiver halves (``make_sender``, ``make_receiver``), whether
every learner rank sends its own part (``all_ranks_send``) and how the ranks' parts become one message
(``merge_messages``).

Invariants:
- ``sync`` drives one message at a time (``weights.base.drive_bucketed_sync``): at most one bucket
  in flight, the sender aborted on any failure, the sync complete only when every receiver returned
  the version from the summary.
- Under ZeRO-3 every learner rank exports (its gathers are collective); with ``all_ranks_send`` every
  rank sends its own GPU's part, else rank 0 alone; an abort reaches every rank. A rank other than 0
  of a transport where only rank 0 sends exports in lockstep and drops its buckets.
"""
from __future__ import annotations

from typing import Any, ClassVar

from weights.base import ExportOnly, drive_bucketed_sync, maybe_await
from weights.protocol import Link, ReceiverStep, SenderStep, Transport, WeightsCall
from weights.wire import SyncSummary, WeightSyncError


class Start(SenderStep, frozen=True):
    """Opens a sync: the rank builds its sender half and starts the export."""

    version: int
    bucket_mb: float

    def run(self, transport: BucketedTransport, end: Any) -> None:
        return transport.start(end, self.version, self.bucket_mb)


class Next(SenderStep, frozen=True):
    """The next message: a bucket, or the summary after the last; the ranks' parts merged into one."""

    def run(self, transport: BucketedTransport, end: Any) -> Any:
        return transport.next_bucket(end)

    def merge(self, transport: BucketedTransport, replies: list) -> Any:
        return transport.merge_messages(replies) if len(replies) > 1 else replies[0]


class Abort(SenderStep, frozen=True):
    """Drops the export and any held buffers, on every rank."""

    every_rank: ClassVar[bool] = True

    def run(self, transport: BucketedTransport, end: Any) -> None:
        return transport.abort(end)


class Receive(ReceiverStep, frozen=True):
    """One message (a bucket, the summary or an abort) into the generator's receiver half."""

    message: Any

    async def run(self, transport: BucketedTransport, end: Any) -> tuple[Any, int | None]:
        return await transport.receive(end, self.message)


class BucketedTransport(Transport):
    """A per-bucket transport: subclasses set `key` and build the halves."""

    per_bucket = True
    sender_steps = (Start, Next, Abort)
    receiver_steps = (Receive,)

    def all_ranks_send(self) -> bool:
        """Whether every learner rank holds a part of each bucket (CUDA IPC: each rank's own GPU)."""
        return False

    def merge_messages(self, messages: list) -> Any:
        """Several learner ranks' messages for one bucket -> the one message receivers get
        (default: rank 0's; the others only took part in collective gathers)."""
        return messages[0]

    # -- the coordinator ----------------------------------------------------------------------------

    async def sync(self, link: Link, version: int, bucket_mb: float) -> None:
        await link.to_sender(self.call(Start(version, bucket_mb)))

        async def next_message() -> Any:
            message = await link.to_sender(self.call(Next()))
            if isinstance(message, SyncSummary):
                link.summary = message  # what the sender moved: the coordinator logs its bytes
            return message

        got = await drive_bucketed_sync(
            next_message,
            [lambda m, r=r: maybe_await(r(self.call(Receive(m)))) for r in link.receivers],
            abort=lambda: link.to_sender(self.call(Abort())))
        if got != version:
            raise WeightSyncError(f"weight sync finished at version {got}, expected {version}")

    # -- the learner group --------------------------------------------------------------------------

    def fan_out(self, call: WeightsCall, world_size: int, zero_stage: int) -> list[tuple[int, WeightsCall]]:
        if call.step.every_rank or self.all_ranks_send() or zero_stage == 3:
            return [(rank, call) for rank in range(world_size)]
        return [(0, call)]

    # -- a learner rank: the sender half ------------------------------------------------------------

    def start(self, end: Any, version: int, bucket_mb: float) -> None:
        if end.rank > 0 and not self.all_ranks_send():
            sender = ExportOnly(end.export_weights, bucket_mb)
        else:
            sender = self.make_sender(end.export_weights, bucket_mb, rank=end.rank)
        end.halves[self.key] = sender
        sender.start(version)

    def next_bucket(self, end: Any) -> Any:
        sender = end.halves.get(self.key)
        if sender is None:
            raise WeightSyncError(f"weight sync {self.key}: Next before Start")
        return sender.next_bucket()

    def abort(self, end: Any) -> None:
        sender = end.halves.get(self.key)
        if sender is not None:
            sender.abort()

    # -- a generator: the receiver half -------------------------------------------------------------

    async def receive(self, end: Any, message: Any) -> tuple[Any, int | None]:
        version = await end.receiver(self).receive(message)
        return version, version
