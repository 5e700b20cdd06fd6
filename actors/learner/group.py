"""The learner as a group of rank actors: one torch.distributed world, DeepSpeed data parallel.

Invariants:
- Rank i is the Ray actor `<names>:learner-<i>`, one process each (on GPU one GPU each), created by the
  launcher (launch/create.py create_learner), never by the group; rank 0 is `ranks[0]`. A world of one keeps its in-process HashStore (no socket at all).
- A world of N rendezvous on a TCPStore that rank 0 binds (never on every interface) on a free port:
  on loopback when every rank runs on one node, else on rank 0's node address as Ray reports it; each
  rank's gloo groups bind the same way (loopback, or its own node address: world.world_hosts). Every wait is bounded: the store's
  and the process group's timeouts, and `joined` waits at most `timeout_s` for the ranks to join.
- Every method the coordinator and the launcher call is an `async def` that fans out to every rank
  that must take part (collectives: every rank; the stream, the step ledger: rank 0 only) and
  returns rank 0's result. The coordinator's LearnerHandle (actors/handles.py) awaits it like an actor
  method. A rank's method is named by attribute (`lambda r: r.sleep`), never by a string.
- Every rank's call is bounded: `call_timeout_s` (coordinator.call_timeout_s), a training step's by
  `train_timeout_s` (coordinator.step_timeout_s), taking the batch by its own wait plus call_timeout_s.
  A rank past its bound (frozen: alive to Ray, silent) raises ActorCallTimeout naming the method and
  the rank(s), which the launcher handles as a death; a rank's error ends the wait at once.
- A step's TrainBatch is read from the `batches` stream by rank 0 alone; every rank trains on the
  same bytes (rank 0 puts them in the object store once); the message is acked only after every
  rank finished the step, so a rank that dies mid-step leaves it pending for the resumed run.
- Weight sync is one verb, `send_weights(call)`: the transport says which ranks take part in each of
  its steps and how their replies become one (`fan_out` / `merge`, weights/). Under ZeRO-3 the export
  is collective, so every rank iterates it in lockstep and only rank 0's buckets leave
  (object_store, nccl); with cuda_ipc every rank sends for its own GPU and the buckets are merged.

The group is a plain picklable object (actor handles and numbers), so it travels to the
coordinator actor like a single handle did.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import structlog

from actors.handles import method_name
from actors.shell import ActorCallTimeout
from config import CoordinatorConfig

log = structlog.get_logger("arctic_rl.learner")

JOIN_TIMEOUT_S = 1800.0  # create(): every rank built its learner (model load + deepspeed.initialize)
_DEFAULTS = CoordinatorConfig()  # the bounds of a group made without a config (tests, benches)


class LearnerGroup:
    """Handles of the rank actors (rank 0 first) and the calls that fan out to them."""

    def __init__(self, ranks: list, zero_stage: int = 0, call_timeout_s: float = _DEFAULTS.call_timeout_s,
                 train_timeout_s: float = _DEFAULTS.step_timeout_s):
        if not ranks:
            raise ValueError("a LearnerGroup needs at least one rank")
        self.ranks = list(ranks)
        self.zero_stage = int(zero_stage)
        self.call_timeout_s, self.train_timeout_s = float(call_timeout_s), float(train_timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def joined(cls, ranks: list, zero_stage: int = 0, timeout_s: float = JOIN_TIMEOUT_S,
               **bounds: float) -> "LearnerGroup":
        """The group over rank actors the launcher created (launch/create.py create_learner), rank 0
        first; a world > 1 waits until all joined one world (at most `timeout_s`). `bounds`:
        call_timeout_s, train_timeout_s (the constructor's)."""
        group = cls(ranks, zero_stage, **bounds)
        if group.world_size > 1:
            group._join(timeout_s)
        return group

    def _join(self, timeout_s: float) -> None:
        import ray

        from actors.learner.world import world_hosts

        t0 = time.monotonic()
        wait = min(timeout_s, 600.0)
        store_host, local_hosts = world_hosts(ray.get([r.node_ip.remote() for r in self.ranks], timeout=wait))
        host, port = ray.get(self.ranks[0].listen.remote(store_host), timeout=wait)
        refs = [r.join.remote(host, port, local) for r, local in zip(self.ranks, local_hosts)]
        pending = list(refs)
        deadline = t0 + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
            ray.get(ready)  # a rank that failed to start raises here, naming its error
            if pending and time.monotonic() >= deadline:
                missing = [i for i, ref in enumerate(refs) if ref in pending]
                raise TimeoutError(f"learner ranks {missing} did not join the world of {self.world_size} "
                                   f"at {host}:{port} within {timeout_s:.0f} s")
        log.info("learner.group_ready", world_size=self.world_size, host=host, port=port,
                 s=round(time.monotonic() - t0, 2))

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            try:
                ray.kill(r, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # ------------------------------------------------------------------ fan-out helpers

    async def _gather(self, what: str, calls: list, bound_s: float | None = None) -> list:
        """The results of `calls` ((rank, ObjectRef) pairs) in order. The first error raised ends the
        wait (raised as is); ranks still silent after `bound_s` (call_timeout_s) are named in an
        ActorCallTimeout, with `what` (the call: the rank method's name, or the step's phase)."""
        timeout_s = self.call_timeout_s if bound_s is None else bound_s
        futures = [asyncio.ensure_future(_awaited(ref)) for _, ref in calls]
        try:
            done, pending = await asyncio.wait(futures, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for f in futures:
                if not f.done():
                    f.cancel()  # the wait ended (an error, the bound, our caller cancelled): stop awaiting
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()
        if pending:
            silent = [rank for (rank, _), f in zip(calls, futures) if f in pending]
            raise ActorCallTimeout.of(f"learner.{what} on rank(s) {silent} of {self.world_size}", timeout_s)
        return [f.result() for f in futures]

    async def _all(self, pick: Callable[[Any], Any], *args) -> list:
        """`pick(rank)` (one of the rank actor's methods, `lambda r: r.sleep`) called on every rank."""
        return await self._gather(method_name(pick(self.ranks[0])),
                                  [(i, pick(r).remote(*args)) for i, r in enumerate(self.ranks)])

    async def _rank0(self, pick: Callable[[Any], Any], *args, bound_s: float | None = None):
        method = pick(self.ranks[0])
        return (await self._gather(method_name(method), [(0, method.remote(*args))], bound_s))[0]

    # ------------------------------------------------------------------ what the coordinator calls

    async def connect(self) -> None:
        """Rank 0 connects to the run's batches stream (its RunContext's Redis URL)."""
        await self._rank0(lambda r: r.connect)

    async def train_from_stream(self, step: int, timeout_s: float = 600.0) -> dict:
        """Trains every rank on the batch for `step` (read by rank 0); rank 0 acks it afterwards."""
        if self.world_size == 1:
            return await self._rank0(lambda r: r.train_from_stream, step, timeout_s,
                                     bound_s=timeout_s + self.train_timeout_s + self.call_timeout_s)
        shared = await self._rank0(lambda r: r.take_batch, step, timeout_s,  # [ObjectRef of the batch bytes]
                                   bound_s=timeout_s + self.call_timeout_s)
        outs = await self._gather("train_step", [(0, self.ranks[0].train_taken.remote())] +
                                  [(i, r.train_bytes.remote(shared[0])) for i, r in enumerate(self.ranks) if i],
                                  self.train_timeout_s)
        return await self._rank0(lambda r: r.finish_taken, outs[0])

    async def sft_step(self, pairs, lr=None) -> float:
        return (await self._all(lambda r: r.sft_step, pairs, lr))[0]

    async def sft_steps(self, chunks, lr=None) -> dict:
        """Many warm-start steps in one call per rank (each rank loops; every step's collectives pair up
        as in `sft_step`): rank 0's {"losses", "seconds"}."""
        return (await self._all(lambda r: r.sft_steps, chunks, lr))[0]

    async def sleep(self) -> None:
        await self._all(lambda r: r.sleep)

    async def wake(self) -> None:
        await self._all(lambda r: r.wake)

    async def save(self, path: str) -> str:
        return (await self._all(lambda r: r.save, path))[0]

    async def load(self, path: str) -> int:
        steps = await self._all(lambda r: r.load, path)
        if len(set(steps)) != 1:
            raise RuntimeError(f"learner ranks resumed at different steps {steps} from {path}")
        return steps[0]

    async def export_hf(self, path: str) -> str:
        return (await self._all(lambda r: r.export_hf, path))[0]

    async def save_base(self, path: str) -> str:
        """learner.lora after the warm start: the trained base as a model directory (rank 0 writes)."""
        return (await self._all(lambda r: r.save_base, path))[0]

    async def memory(self) -> dict:
        """Rank 0's device memory (GiB, peaks since the last call; {} on CPU)."""
        return await self._rank0(lambda r: r.memory)

    async def get_step(self) -> int:
        return await self._rank0(lambda r: r.get_step)

    async def pid(self) -> int:
        return await self._rank0(lambda r: r.pid)

    async def send_weights(self, call):
        """One step of a weight sync: to the ranks the transport names, their replies made one."""
        from weights.strategy import get_transport

        transport = get_transport(call.key.kind)
        plan = transport.fan_out(call, self.world_size, self.zero_stage)
        replies = await self._gather(method_name(self.ranks[0].send_weights),
                                     [(rank, self.ranks[rank].send_weights.remote(c)) for rank, c in plan])
        return transport.merge(call, replies)


async def _awaited(ref):
    """An ObjectRef awaited inside a coroutine (so asyncio can make it a task)."""
    return await ref
