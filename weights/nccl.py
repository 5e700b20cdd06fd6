"""The nccl transport (gloo on CPU): a private group, learner rank 0 broadcasting, at the four places
it runs (weights.protocol). The group itself (its store, its sender and receivers) is weights.broadcast.

Invariants:
- The coordinator builds the group whole (every receiver's ranks, the learner listens, everyone
  joins at once) on the first sync and whenever a receiver is not a member of the current one (Ray
  restarted it, or a sync failed: ``link.group`` is then None); a healthy group is reused.
- Each sync is one ``send`` on the learner beside every receiver's ``receive``; any failure drops the
  group so the next attempt rebuilds it. A receiver's version moves only when it got the whole sync.
- Learner rank 0 sends; under ZeRO-3 the other ranks run the export's gathers beside it (``export``).
- An engine whose weights live in its own workers (vLLM) takes one rank per worker: each worker
  joins as ``first + its tensor-parallel rank`` and takes part in every broadcast.
- Every wait is bounded: the group's rendezvous timeout (the learner's learner.collective_timeout_s),
  and the engine's worker calls 30 s more.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

import torch

from weights.base import ExportOnly
from weights.broadcast import BroadcastReceiver, BroadcastSender, Rendezvous, group_layout
from weights.protocol import Transport, TransportKey, in_workers
from weights.wire import WeightSyncError

log = logging.getLogger(__name__)


class BroadcastTransport(Transport):
    """Disaggregated on GPUs (gloo on CPU): a private group, learner rank 0 broadcasting. Not per
    bucket: the coordinator builds the group whole (every receiver's ranks, the learner listens,
    everyone joins at once) whenever a receiver is not a member of the current one, then each sync is
    one `send` beside every receiver's `receive`. An engine that loads in its own workers (vLLM)
    joins from each worker, one rank per worker."""

    key = TransportKey("nccl")
    per_bucket = False
    blocking_sender_steps = frozenset({"init", "send", "export"})

    def make_sender(self, export_weights, bucket_mb, *, rank=0, device=None, timeout_s=600.0):
        device = torch.device(device if device is not None else "cpu")
        return BroadcastSender(lambda mb: export_weights(mb, device=device), bucket_mb,
                               backend="nccl" if device.type == "cuda" else "gloo", device=device, timeout_s=timeout_s)

    def make_receiver(self, load_weights, engine=None):
        return BroadcastReceiver(load_weights)

    # -- the coordinator ----------------------------------------------------------------------------

    async def sync(self, link, version, bucket_mb):
        await self._group(link, bucket_mb)
        try:
            got = await asyncio.gather(link.to_sender(self.call("send", version)),
                                       link.to_receivers(self.call("receive", version)))
        except BaseException:
            link.group = None  # a rank may be gone or the group broken: rebuild it first
            raise
        got = [got[0], *got[1]]
        if any(v != version for v in got):
            raise WeightSyncError(f"weight sync finished at versions {got}, expected {version}")

    async def _group(self, link, bucket_mb) -> None:
        """On the first sync and whenever a receiver is not a member of the group (Ray restarted it,
        or a sync failed): every rank must join at once, so the group is always rebuilt whole."""
        if link.group is not None:
            joined = await link.to_receivers(self.call("member"))
            if all(j == link.group for j in joined):
                return
        link.group = None
        # A receiver whose engine loads in k workers (vLLM, tensor parallelism k) takes k ranks.
        firsts, world = group_layout(await link.to_receivers(self.call("ranks")))
        rdv = await link.to_sender(self.call("listen", world, bucket_mb))
        await asyncio.gather(link.to_sender(self.call("init")),
                             link.to_receivers(lambda i: self.call("join", rdv, firsts[i])))
        link.group = rdv
        if link.log is not None:
            link.log.info("weight-sync group built", backend=rdv.backend, world_size=rdv.world_size,
                          host=rdv.host, port=rdv.port)

    # -- the learner group: rank 0 sends; under ZeRO-3 the others take part in the export's gathers --

    def fan_out(self, call, world_size, zero_stage):
        if call.op == "send" and zero_stage == 3:
            return [(0, call)] + [(rank, self.call("export")) for rank in range(1, world_size)]
        return [(0, call)]

    def merge(self, call, replies):
        return replies[0]

    # -- a learner rank -----------------------------------------------------------------------------

    def on_sender(self, end, call):
        """listen(world_size, bucket_mb): a new group (closing any previous one) -> its Rendezvous;
        init: join it; send(version) -> the version, once every receiver acknowledged; export: the
        ZeRO-3 gathers alone (ranks > 0)."""
        if call.op not in ("listen", "init", "send", "export"):
            raise self.refuse("sender", call.op)
        if call.op == "listen":
            world_size, bucket_mb = call.args
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
        if call.op == "export":
            ExportOnly(end.export_weights, 512).run()
            return None
        sender = end.halves.get(self.key)
        if sender is None:
            raise WeightSyncError(f"weight sync {self.key}: {call.op!r} before 'listen'")
        if call.op == "init":
            return sender.init()
        return sender.send(call.args[0]).version

    # -- a generator --------------------------------------------------------------------------------

    async def on_receiver(self, end, call):
        """ranks -> how many ranks it takes; member -> the Rendezvous it joined (None after a restart);
        join(rdv, first rank); receive(version) -> the version (the sync completed)."""
        op, in_workers_ = call.op, end.in_workers()
        if op == "ranks":
            return (end.engine.num_workers() if in_workers_ else 1), None
        if op == "member":
            return end.halves.get((self.key, "group")), None
        if op == "join":
            rdv, first = call.args
            old = end.halves.pop(self.key, None)
            end.halves.pop((self.key, "group"), None)
            if old is not None and old != "engine":
                try:
                    old.close()
                except Exception as e:  # noqa: BLE001 - a broken group; the new one replaces it anyway
                    log.warning("closing the previous weight-sync group failed: %r", e)
            if in_workers_:
                await in_workers(end.engine, self.key, "join", dataclasses.asdict(rdv), int(first),
                                 timeout=rdv.timeout_s + 30)  # the group's own waits end first
                receiver = "engine"
            else:
                receiver = BroadcastReceiver(end.load_weights)
                await asyncio.to_thread(receiver.init, rdv, first)
            end.halves[self.key], end.halves[(self.key, "group")] = receiver, rdv
            return None, None
        if op != "receive":
            raise self.refuse("receiver", op)
        receiver, rdv = end.halves.get(self.key), end.halves.get((self.key, "group"))
        if receiver is None:
            raise WeightSyncError("weight sync nccl: this generator is in no weight-sync group (restarted?); "
                                  "it must join first")
        version = int(call.args[0])
        if receiver == "engine":
            got = await in_workers(end.engine, self.key, "receive", version, timeout=rdv.timeout_s + 30)
            if any(g != version for g in got):
                raise WeightSyncError(f"weight sync nccl: engine workers finished versions {got}, expected {version}")
        else:
            version = await receiver.receive_all(version)
        return version, version

    # -- a vLLM worker: each joins as its own rank (first + its tensor-parallel rank) -----------------

    def on_worker(self, worker, op, *args):
        if op == "join":
            rdv, first = Rendezvous(**args[0]), int(args[1])
            rank = first + int(getattr(worker, "rank", 0) or 0)
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
        if op == "receive":
            receiver = getattr(worker, "_arl_receiver", None)
            if receiver is None:
                raise WeightSyncError("weight_sync nccl: this engine worker joined no group (join first)")
            return int(run_coroutine(receiver.receive_all(int(args[0]))))
        raise self.refuse("worker", op)


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
