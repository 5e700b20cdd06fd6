"""The transport strategy's shape: everything a transport does, at all four places it runs.

A sync crosses four places, and a transport (one ``Transport`` subclass in one module) is the only
code that knows what happens at each:

- the coordinator: ``Transport.sync(link, version, bucket_mb)`` drives one sync through a ``Link``,
  the learner's one verb (``send_weights``) and every generator's one verb (``receive_weights``);
- the learner group: ``fan_out`` says which rank gets which ``WeightsCall``, ``merge`` makes the
  ranks' replies one;
- a learner rank: ``on_sender(end, call)`` (``end`` is the rank's ``weights.endpoint.SendEnd``);
- a generator: ``on_receiver(end, call)`` (``weights.endpoint.ReceiveEnd``), and, for an engine whose
  weights live in its own worker processes (vLLM), ``on_worker(worker, op, *args)`` inside each worker.

The shells and the engines only forward: ``send_weights(call)``, ``receive_weights(call)`` and
``Engine.in_workers(key, op, *args)``; none of them knows a transport's name or its steps.

Invariants:
- A ``WeightsCall`` is plain data (a key, the transport's own step name, plain arguments), so it
  crosses Ray and vLLM's msgpack RPC alike; a step a transport does not have is a one-line
  WeightSyncError naming the transport and the step.
- ``per_bucket`` transports are driven one message at a time (``weights.base.drive_bucketed_sync``:
  at most one bucket in flight, the sender aborted on any failure); the others (a collective group)
  run one call per side per sync, after building their group when ``link.group`` is not every
  receiver's.
- Both halves keep the counting of weights.base: a partial sync never bumps the receiver's version; a
  receiver reports a sync complete (``on_receiver``'s second value) only once it is whole, and only
  then does the generator end the engine's update.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from weights.base import ExportOnly, drive_bucketed_sync, maybe_await
from weights.wire import SyncSummary, WeightSyncError

@dataclass(frozen=True)
class TransportKey:
    """What picks a transport: the placement's kind (coordinator.weight_sync)."""

    kind: str  # object_store | cuda_ipc | nccl

    def __str__(self) -> str:
        return self.kind


@dataclass(frozen=True)
class WeightsCall:
    """One step of a transport, sent to a learner rank (send_weights) or a generator (receive_weights)."""

    key: TransportKey
    op: str
    args: tuple = ()


Verb = Callable[[WeightsCall], Awaitable[Any] | Any]


@dataclass
class Link:
    """The coordinator's two ends of one sync: the learner's verb and each generator's verb.
    `group` is a collective transport's group every receiver joined (None: build it first); the
    transport updates it, and the coordinator keeps it for the next sync."""

    send: Verb
    receivers: list[Verb]
    group: Any = None
    log: Any = None
    summary: Any = None  # the sender's SyncSummary of the last sync (tensors, bytes), where the transport sees one

    async def to_sender(self, call: WeightsCall) -> Any:
        return await maybe_await(self.send(call))

    async def to_receivers(self, call: WeightsCall | Callable[[int], WeightsCall]) -> list:
        """`call`, or `call(i)` for receiver i, to every receiver at once."""
        calls = [call(i) if callable(call) else call for i in range(len(self.receivers))]
        return list(await asyncio.gather(*(maybe_await(r(c)) for r, c in zip(self.receivers, calls))))


def verb(method: Any) -> Verb:
    """A Ray actor method (`handle.send_weights`) or a plain one, as a callable the Link awaits."""
    return getattr(method, "remote", method)


class Transport:
    """One transport. Subclasses set `key` and `per_bucket`, build the halves (`make_sender`,
    `make_receiver`) and, where they need it, override the steps below. The defaults are the
    per-bucket protocol: sender steps start / next / abort, receiver step receive."""

    key: TransportKey
    per_bucket: bool = True
    # Sender steps that block on a collective or a peer: the rank's end runs them in a thread.
    blocking_sender_steps: frozenset = frozenset()

    def call(self, op: str, *args: Any) -> WeightsCall:
        return WeightsCall(self.key, op, tuple(args))

    def refuse(self, where: str, op: str) -> WeightSyncError:
        return WeightSyncError(f"weight sync {self.key}: no {where} step {op!r}")

    # -- the halves ---------------------------------------------------------------------------------

    def make_sender(self, export_weights: Callable[..., Any], bucket_mb: float, *, rank: int = 0,
                    device: Any = None) -> Any:
        """Learner side. `export_weights(bucket_mb, device=...)` yields buckets of (name, tensor)."""
        raise NotImplementedError

    def make_receiver(self, load_weights: Callable[..., Any], engine: Any = None) -> Any:
        """Generator side. `engine` is given when it loads in its own worker processes (vLLM)."""
        raise NotImplementedError

    def all_ranks_send(self) -> bool:
        """Whether every learner rank holds a part of each bucket (CUDA IPC: each rank's own GPU)."""
        return False

    def merge_messages(self, messages: list) -> Any:
        """Several learner ranks' messages for one bucket -> the one message receivers get
        (default: rank 0's; the others only took part in collective gathers)."""
        return messages[0]

    # -- the coordinator ----------------------------------------------------------------------------

    async def sync(self, link: Link, version: int, bucket_mb: float) -> None:
        """One whole sync learner -> every receiver; raises (receivers keep their version) on failure."""
        await link.to_sender(self.call("start", version, bucket_mb))

        async def next_message() -> Any:
            message = await link.to_sender(self.call("next"))
            if isinstance(message, SyncSummary):
                link.summary = message  # what the sender moved: the coordinator logs its bytes
            return message

        got = await drive_bucketed_sync(
            next_message,
            [lambda m, r=r: maybe_await(r(self.call("receive", m))) for r in link.receivers],
            abort=lambda: link.to_sender(self.call("abort")))
        if got != version:
            raise WeightSyncError(f"weight sync finished at version {got}, expected {version}")

    # -- the learner group --------------------------------------------------------------------------

    def fan_out(self, call: WeightsCall, world_size: int, zero_stage: int) -> list[tuple[int, WeightsCall]]:
        """(rank, call) for every rank that takes part in `call`. Per bucket: under ZeRO-3 every
        rank exports (its gathers are collective), with all_ranks_send every rank sends its own GPU's
        part, else rank 0 alone; an abort goes to every rank."""
        if call.op == "abort" or self.all_ranks_send() or zero_stage == 3:
            return [(rank, call) for rank in range(world_size)]
        return [(0, call)]

    def merge(self, call: WeightsCall, replies: list) -> Any:
        if call.op == "next" and len(replies) > 1:
            return self.merge_messages(list(replies))
        return replies[0]

    # -- a learner rank -----------------------------------------------------------------------------

    def on_sender(self, end: Any, call: WeightsCall) -> Any:
        """A per-bucket sender step on a learner rank (weights.endpoint.SendEnd). A rank other than 0
        of a transport where only rank 0 sends exports in lockstep and drops its buckets."""
        if call.op not in ("start", "next", "abort"):
            raise self.refuse("sender", call.op)
        if call.op == "start":
            version, bucket_mb = call.args
            if end.rank > 0 and not self.all_ranks_send():
                sender = ExportOnly(end.export_weights, bucket_mb)
            else:
                sender = self.make_sender(end.export_weights, bucket_mb, rank=end.rank)
            end.halves[self.key] = sender
            sender.start(version)
            return None
        sender = end.halves.get(self.key)
        if call.op == "next":
            if sender is None:
                raise WeightSyncError(f"weight sync {self.key}: 'next' before 'start'")
            return sender.next_bucket()
        if sender is not None:  # abort
            sender.abort()
        return None

    # -- a generator --------------------------------------------------------------------------------

    async def on_receiver(self, end: Any, call: WeightsCall) -> tuple[Any, int | None]:
        """A receiver step in a generator (weights.endpoint.ReceiveEnd): (reply, the version a sync
        just completed or None)."""
        if call.op != "receive":
            raise self.refuse("receiver", call.op)
        receiver = end.receiver(self)
        version = await receiver.receive(call.args[0])
        return version, version

    # -- a vLLM worker ------------------------------------------------------------------------------

    def on_worker(self, worker: Any, op: str, *args: Any) -> Any:
        """A step inside an engine's worker process (actors/engines/vllm_worker.py); `worker` has
        `arl_device()`, `arl_load(named)` and `rank`."""
        raise self.refuse("worker", op)


async def in_workers(engine: Any, key: TransportKey, op: str, *args: Any, expect: int | None = None,
                     timeout: float | None = 600.0) -> list:
    """`op` of transport `key` in every worker of `engine`; with `expect`, every worker must report
    loading that many tensors."""
    results = await engine.in_workers(key, op, *args, timeout=timeout)
    if expect is not None and any(r != expect for r in results):
        raise WeightSyncError(f"weight sync {key} {op}: workers loaded {results} tensors, the bucket has {expect}")
    return results
