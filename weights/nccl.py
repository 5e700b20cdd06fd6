"""The nccl transport (gloo on CPU): a private group, learner rank 0 broadcasting, at the four places
it runs (weights.protocol). The group itself (its store, its sender and receivers) is weights.broadcast.

Invariants:
- The coordinator builds the group whole (every receiver's ranks, the learner listens, everyone
  joins at once) on the first sync and whenever a receiver is not a member of the current one (Ray
  restarted it, or a sync failed: ``link.group`` is then None); a healthy group is reused.
- Each sync is one ``Send`` on the learner beside every receiver's ``ReceiveAll``; any failure drops
  the group so the next attempt rebuilds it. A receiver's version moves only when it got the whole sync.
- Learner rank 0 sends; under ZeRO-3 the other ranks run the export's gathers beside it (``Export``).
- An engine whose weights live in its own workers (vLLM) takes one rank per worker: each worker
  joins as ``first + its tensor-parallel rank`` and takes part in every broadcast.
- Every wait is bounded: the group's rendezvous timeout (the learner's learner.collective_timeout_s),
  and the engine's worker calls 30 s more.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, ClassVar

from weights.base import ExportOnly
from weights.broadcast import BroadcastReceiver, BroadcastSender, Rendezvous, group_layout
from weights.protocol import (
    Link,
    ReceiverStep,
    SenderStep,
    Transport,
    TransportKey,
    WeightsCall,
    WorkerStep,
    in_workers,
)
from weights.wire import WeightSyncError

log = logging.getLogger(__name__)
IN_WORKERS = "engine"  # a generator's receiver slot when its engine's workers joined the group themselves


# -- the steps: a learner rank's ------------------------------------------------------------------

class Listen(SenderStep, frozen=True):
    """A new group (closing any previous one) -> its Rendezvous."""

    world_size: int
    bucket_mb: float

    def run(self, transport: BroadcastTransport, end: Any) -> Rendezvous:
        return transport.listen(end, self.world_size, self.bucket_mb)


class Init(SenderStep, frozen=True):
    """Join the group, beside every receiver's Join."""

    blocking: ClassVar[bool] = True

    def run(self, transport: BroadcastTransport, end: Any) -> None:
        return transport.init(end)


class Send(SenderStep, frozen=True):
    """The whole sync, beside every receiver's ReceiveAll -> the version, once every receiver acknowledged."""

    blocking: ClassVar[bool] = True
    version: int

    def run(self, transport: BroadcastTransport, end: Any) -> int:
        return transport.send(end, self.version)


class Export(SenderStep, frozen=True):
    """A rank other than 0 under ZeRO-3: the export's gathers alone, beside rank 0's Send."""

    blocking: ClassVar[bool] = True

    def run(self, transport: BroadcastTransport, end: Any) -> None:
        return transport.export(end)


# -- a generator's --------------------------------------------------------------------------------

class Ranks(ReceiverStep, frozen=True):
    """How many ranks this generator takes in the group (one per engine worker)."""

    async def run(self, transport: BroadcastTransport, end: Any) -> tuple[int, None]:
        return await transport.ranks(end)


class Member(ReceiverStep, frozen=True):
    """The Rendezvous this generator joined (None after a restart)."""

    async def run(self, transport: BroadcastTransport, end: Any) -> tuple[Any, None]:
        return await transport.member(end)


class Join(ReceiverStep, frozen=True):
    """Join the group at rank `first` (its workers at first, first + 1, ...), beside the learner's Init."""

    rdv: Rendezvous
    first: int

    async def run(self, transport: BroadcastTransport, end: Any) -> tuple[None, None]:
        return await transport.join(end, self.rdv, self.first)


class ReceiveAll(ReceiverStep, frozen=True):
    """The whole sync, beside the learner's Send -> (version, version) once it arrived whole."""

    version: int

    async def run(self, transport: BroadcastTransport, end: Any) -> tuple[int, int]:
        return await transport.receive(end, self.version)


# -- an engine worker's ---------------------------------------------------------------------------

class WorkerJoin(WorkerStep, frozen=True):
    """This worker joins as rank first + its tensor-parallel rank."""

    rdv: Rendezvous
    first: int

    def run(self, transport: BroadcastTransport, worker: Any) -> int:
        return transport.worker_join(worker, self.rdv, self.first)


class WorkerReceive(WorkerStep, frozen=True):
    """This worker's part of one broadcast sync -> the version."""

    version: int

    def run(self, transport: BroadcastTransport, worker: Any) -> int:
        return transport.worker_receive(worker, self.version)


class BroadcastTransport(Transport):
    """Disaggregated on GPUs (gloo on CPU): a private group, learner rank 0 broadcasting. Not per
    bucket: the coordinator builds the group whole (every receiver's ranks, the learner listens,
    everyone joins at once) whenever a receiver is not a member of the current one, then each sync is
    one `Send` beside every receiver's `ReceiveAll`. An engine that loads in its own workers (vLLM)
    joins from each worker, one rank per worker."""

    key = TransportKey("nccl")
    per_bucket = False
    sender_steps = (Listen, Init, Send, Export)
    receiver_steps = (Ranks, Member, Join, ReceiveAll)
    worker_steps = (WorkerJoin, WorkerReceive)

    def make_sender(self, export_weights, bucket_mb, *, rank=0, device=None, timeout_s=600.0):
        import torch

        device = torch.device(device if device is not None else "cpu")
        return BroadcastSender(lambda mb: export_weights(mb, device=device), bucket_mb,
                               backend="nccl" if device.type == "cuda" else "gloo", device=device, timeout_s=timeout_s)

    def make_receiver(self, load_weights, engine=None):
        return BroadcastReceiver(load_weights)

    # -- the coordinator ----------------------------------------------------------------------------

    async def sync(self, link: Link, version: int, bucket_mb: float) -> None:
        await self._group(link, bucket_mb)
        try:
            got = await asyncio.gather(link.to_sender(self.call(Send(version))),
                                       link.to_receivers(self.call(ReceiveAll(version))))
        except BaseException:
            link.group = None  # a rank may be gone or the group broken: rebuild it first
            raise
        got = [got[0], *got[1]]
        if any(v != version for v in got):
            raise WeightSyncError(f"weight sync finished at versions {got}, expected {version}")

    async def _group(self, link: Link, bucket_mb: float) -> None:
        """On the first sync and whenever a receiver is not a member of the group (Ray restarted it,
        or a sync failed): every rank must join at once, so the group is always rebuilt whole."""
        if link.group is not None:
            joined = await link.to_receivers(self.call(Member()))
            if all(j == link.group for j in joined):
                return
        link.group = None
        # A receiver whose engine loads in k workers (vLLM, tensor parallelism k) takes k ranks.
        firsts, world = group_layout(await link.to_receivers(self.call(Ranks())))
        rdv = await link.to_sender(self.call(Listen(world, bucket_mb)))
        await asyncio.gather(link.to_sender(self.call(Init())),
                             link.to_receivers(lambda i: self.call(Join(rdv, firsts[i]))))
        link.group = rdv
        if link.log is not None:
            link.log.info("weight-sync group built", backend=rdv.backend, world_size=rdv.world_size,
                          host=rdv.host, port=rdv.port)

    # -- the learner group: rank 0 sends; under ZeRO-3 the others take part in the export's gathers --

    def fan_out(self, call: WeightsCall, world_size: int, zero_stage: int) -> list[tuple[int, WeightsCall]]:
        if isinstance(call.step, Send) and zero_stage == 3:
            return [(0, call)] + [(rank, self.call(Export())) for rank in range(1, world_size)]
        return [(0, call)]

    # -- a learner rank: the sender half ------------------------------------------------------------

    def listen(self, end: Any, world_size: int, bucket_mb: float) -> Rendezvous:
        old = end.halves.pop(self.key, None)
        if old is not None:
            try:
                old.close()
            except Exception as e:  # noqa: BLE001 - a broken group (a send may still be failing in its thread)
                log.warning("closing the previous weight-sync group failed: %r", e)
        sender = self.make_sender(end.export_weights, bucket_mb, rank=end.rank, device=end.device,
                                  timeout_s=end.timeout_s)  # the group's and its store's bound
        end.halves[self.key] = sender
        return sender.listen(world_size)

    def _sender(self, end: Any, step: str) -> BroadcastSender:
        sender = end.halves.get(self.key)
        if sender is None:
            raise WeightSyncError(f"weight sync {self.key}: {step} before Listen")
        return sender

    def init(self, end: Any) -> None:
        return self._sender(end, "Init").init()

    def send(self, end: Any, version: int) -> int:
        return self._sender(end, "Send").send(version).version

    def export(self, end: Any) -> None:
        ExportOnly(end.export_weights, 512).run()

    # -- a generator: the receiver half -------------------------------------------------------------

    async def ranks(self, end: Any) -> tuple[int, None]:
        return (end.engine.num_workers() if end.in_workers() else 1), None

    async def member(self, end: Any) -> tuple[Any, None]:
        return end.halves.get((self.key, "group")), None

    async def join(self, end: Any, rdv: Rendezvous, first: int) -> tuple[None, None]:
        old = end.halves.pop(self.key, None)
        end.halves.pop((self.key, "group"), None)
        if old is not None and old != IN_WORKERS:
            try:
                old.close()
            except Exception as e:  # noqa: BLE001 - a broken group; the new one replaces it anyway
                log.warning("closing the previous weight-sync group failed: %r", e)
        if end.in_workers():
            await in_workers(end.engine, self.key, WorkerJoin(rdv, int(first)),
                             timeout=rdv.timeout_s + 30)  # the group's own waits end first
            receiver: Any = IN_WORKERS
        else:
            receiver = BroadcastReceiver(end.load_weights)
            await asyncio.to_thread(receiver.init, rdv, first)
        end.halves[self.key], end.halves[(self.key, "group")] = receiver, rdv
        return None, None

    async def receive(self, end: Any, version: int) -> tuple[int, int]:
        receiver, rdv = end.halves.get(self.key), end.halves.get((self.key, "group"))
        if receiver is None:
            raise WeightSyncError("weight sync nccl: this generator is in no weight-sync group (restarted?); "
                                  "it must join first")
        version = int(version)
        if receiver == IN_WORKERS:
            got = await in_workers(end.engine, self.key, WorkerReceive(version), timeout=rdv.timeout_s + 30)
            if any(g != version for g in got):
                raise WeightSyncError(f"weight sync nccl: engine workers finished versions {got}, expected {version}")
        else:
            version = await receiver.receive_all(version)
        return version, version

    # -- a vLLM worker: each joins as its own rank (first + its tensor-parallel rank) -----------------

    def worker_join(self, worker: Any, rdv: Rendezvous, first: int) -> int:
        rank = int(first) + int(getattr(worker, "rank", 0) or 0)
        if not 1 <= rank < rdv.world_size:
            raise WeightSyncError(
                f"weight_sync nccl: this engine worker needs rank {rank} but the group's world_size is "
                f"{rdv.world_size} (give each generator one rank per engine worker)")
        old = getattr(worker, "_arl_receiver", None)
        if old is not None:
            old.close()
        receiver = BroadcastReceiver(lambda named, version: worker.arl_load(named), device=worker.arl_device())
        receiver.init(rdv, rank)
        worker._arl_receiver = receiver
        return rank

    def worker_receive(self, worker: Any, version: int) -> int:
        receiver = getattr(worker, "_arl_receiver", None)
        if receiver is None:
            raise WeightSyncError("weight_sync nccl: this engine worker joined no group (join first)")
        return int(run_coroutine(receiver.receive_all(int(version))))


def run_coroutine(coro: Any) -> Any:
    """Runs `coro` to completion from synchronous code, also when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="arl-weight-sync", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


TRANSPORT = BroadcastTransport()
