"""The transport strategy's shape: everything a transport does, at all four places it runs.

A sync crosses four places, and a transport (one ``Transport`` subclass in one module) is the only
code that knows what happens at each:

- the coordinator: ``Transport.sync(link, version, bucket_mb)`` drives one sync through a ``Link``,
  the learner's one verb (``send_weights``) and every generator's one verb (``receive_weights``);
- the learner group: ``fan_out`` says which rank gets which ``WeightsCall``, ``merge`` makes the
  ranks' replies one;
- a learner rank: its sender half, a ``SenderStep`` at a time (``end`` is the rank's
  ``weights.endpoint.SendEnd``);
- a generator: its receiver half, a ``ReceiverStep`` at a time (``weights.endpoint.ReceiveEnd``),
  and, for an engine whose weights live in its own worker processes (vLLM), a ``WorkerStep`` inside
  each worker.

A step is a typed message (a msgspec Struct) whose ``run`` calls the transport's method for it, so a
reader goes from the message to the method by "go to definition"; each transport lists the steps it
takes (``sender_steps``, ``receiver_steps``, ``worker_steps``). The shells and the engines only
forward: ``send_weights(call)``, ``receive_weights(call)`` and ``Engine.in_workers(key, step)``; none
of them knows a transport's name or its steps.

Invariants:
- A ``WeightsCall`` is plain data (the transport's key and one step), so it crosses Ray; a worker step
  crosses vLLM's msgpack RPC as plain builtins (``to_worker``: bytes stay bytes) and is rebuilt typed
  in the worker. A step a transport does not list is a one-line WeightSyncError naming the transport
  and the step.
- ``per_bucket`` transports (weights.bucketed) are driven one message at a time (at most one bucket
  in flight, the sender aborted on any failure); the others (a collective group) run one call per side
  per sync, after building their group when ``link.group`` is not every receiver's.
- Both halves keep the counting of weights.base: a partial sync never bumps the receiver's version; a
  receiver step reports a sync complete (its second value) only once it is whole, and only then does
  the generator end the engine's update.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Union

import msgspec

from weights.base import maybe_await
from weights.wire import WeightSyncError

if TYPE_CHECKING:
    from config.schema import WeightSyncKind


@dataclass(frozen=True)
class TransportKey:
    """What picks a transport: one of the config's kinds (config.schema.WEIGHT_SYNC_KINDS)."""

    kind: WeightSyncKind

    def __str__(self) -> str:
        return self.kind


class SenderStep(msgspec.Struct, frozen=True):
    """One step of a transport's sender half, on a learner rank. `run` calls the transport's method.
    `every_rank`: the learner group sends it to every rank; `blocking`: it waits on a collective or a
    peer, so the rank's end runs it in a thread (the learner actor answers its other calls meanwhile)."""

    every_rank: ClassVar[bool] = False
    blocking: ClassVar[bool] = False

    def run(self, transport: Any, end: Any) -> Any:
        raise NotImplementedError

    def merge(self, transport: Any, replies: list) -> Any:
        """The learner ranks' replies -> the group's one reply (default: rank 0's)."""
        return replies[0]


class ReceiverStep(msgspec.Struct, frozen=True):
    """One step of a transport's receiver half, in a generator: `run` -> (reply, the version a sync
    just completed or None)."""

    async def run(self, transport: Any, end: Any) -> tuple[Any, int | None]:
        raise NotImplementedError


class WorkerStep(msgspec.Struct, frozen=True, tag=True):
    """One step inside an engine's worker process (actors/engines/vllm_worker.py); `worker` has
    `arl_device()`, `arl_load(named)` and `rank`. Fields are plain (bytes, ints, dataclasses of them)."""

    def run(self, transport: Any, worker: Any) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class WeightsCall:
    """One step of a transport, sent to a learner rank (send_weights) or a generator (receive_weights)."""

    key: TransportKey
    step: Any  # a SenderStep or a ReceiverStep of that transport


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


def to_worker(step: WorkerStep) -> dict:
    """A worker step as the plain builtins an engine's RPC carries (vLLM's msgpack): bytes stay bytes."""
    return msgspec.to_builtins(step, builtin_types=(bytes, bytearray, memoryview))


class Transport:
    """One transport. Subclasses set `key`, `per_bucket` and the steps they take, build the halves
    (`make_sender`, `make_receiver`) and define `sync` and each step's method."""

    key: TransportKey
    per_bucket: bool = True
    sender_steps: ClassVar[tuple[type, ...]] = ()
    receiver_steps: ClassVar[tuple[type, ...]] = ()
    worker_steps: ClassVar[tuple[type, ...]] = ()

    def call(self, step: Any) -> WeightsCall:
        return WeightsCall(self.key, step)

    def refuse(self, where: str, step: Any) -> WeightSyncError:
        if isinstance(step, str):
            name = step
        else:  # a worker step's tag is its name on the wire (its class name unless given)
            name = getattr(getattr(step, "__struct_config__", None), "tag", None) or type(step).__name__
        return WeightSyncError(f"weight sync {self.key}: no {where} step {name!r}")

    # -- the halves ---------------------------------------------------------------------------------

    def make_sender(self, export_weights: Callable[..., Any], bucket_mb: float, *, rank: int = 0,
                    device: Any = None) -> Any:
        """Learner side. `export_weights(bucket_mb, device=...)` yields buckets of (name, tensor)."""
        raise NotImplementedError

    def make_receiver(self, load_weights: Callable[..., Any], engine: Any = None) -> Any:
        """Generator side. `engine` is given when it loads in its own worker processes (vLLM)."""
        raise NotImplementedError

    # -- the coordinator ----------------------------------------------------------------------------

    async def sync(self, link: Link, version: int, bucket_mb: float) -> None:
        """One whole sync learner -> every receiver; raises (receivers keep their version) on failure."""
        raise NotImplementedError

    # -- the learner group --------------------------------------------------------------------------

    def fan_out(self, call: WeightsCall, world_size: int, zero_stage: int) -> list[tuple[int, WeightsCall]]:
        """(rank, call) for every rank that takes part in `call` (default: a step marked every_rank
        goes to every rank, the others to rank 0)."""
        if call.step.every_rank:
            return [(rank, call) for rank in range(world_size)]
        return [(0, call)]

    def merge(self, call: WeightsCall, replies: list) -> Any:
        return call.step.merge(self, list(replies))

    # -- the ends: a learner rank, a generator, an engine's worker ----------------------------------

    def on_sender(self, end: Any, step: SenderStep) -> Any:
        """A sender step on a learner rank (weights.endpoint.SendEnd)."""
        if type(step) not in self.sender_steps:
            raise self.refuse("sender", step)
        return step.run(self, end)

    async def on_receiver(self, end: Any, step: ReceiverStep) -> tuple[Any, int | None]:
        """A receiver step in a generator (weights.endpoint.ReceiveEnd): (reply, the version a sync
        just completed or None)."""
        if type(step) not in self.receiver_steps:
            raise self.refuse("receiver", step)
        return await step.run(self, end)

    def on_worker(self, worker: Any, step: WorkerStep | dict) -> Any:
        """A worker step inside an engine's worker process, typed or as it crossed the RPC (to_worker)."""
        if isinstance(step, dict):
            if not self.worker_steps:
                raise self.refuse("worker", step.get("type", "?"))
            try:
                step = msgspec.convert(step, Union[self.worker_steps])  # type: ignore[arg-type]
            except msgspec.ValidationError as e:
                raise self.refuse("worker", str(step.get("type", "?"))) if "$.type" in str(e) else \
                    WeightSyncError(f"weight sync {self.key}: worker step {step.get('type')!r}: {e}") from None
        if type(step) not in self.worker_steps:
            raise self.refuse("worker", step)
        return step.run(self, worker)


async def in_workers(engine: Any, key: TransportKey, step: WorkerStep, expect: int | None = None,
                     timeout: float | None = 600.0) -> list:
    """`step` of transport `key` in every worker of `engine`; with `expect`, every worker must report
    loading that many tensors."""
    results = await engine.in_workers(key, to_worker(step), timeout=timeout)
    if expect is not None and any(r != expect for r in results):
        raise WeightSyncError(f"weight sync {key} {type(step).__name__}: workers loaded {results} tensors, "
                              f"the bucket has {expect}")
    return results
