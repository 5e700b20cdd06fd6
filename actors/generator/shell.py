"""GeneratorShell: the thin Ray shell (an async actor; `GeneratorActor` is its Ray class) over one
actors.generator.generator.Generator.

Invariants:
- It takes the node-local GPU ids of its engine's bundles (`device_ids`, from the placement) and
  sets CUDA_VISIBLE_DEVICES to exactly those before the engine is built, so an engine's
  tensor-parallel workers land on them.
- Weight-sync messages go to the engine as they came when its weights live in its own worker
  processes (vLLM: `loads_in_workers`), else as tensors through `load_weights`.
- A generator Ray restarted serves nothing until the coordinator has synced it (`health()`).
"""
from __future__ import annotations

import asyncio
from typing import Any

import structlog

from actors.generator.generator import Generator
from queues.errors import one_line

log = structlog.get_logger("arctic_rl.generator")


class GeneratorShell:
    """Async Ray actor over one Generator; run() loops while control calls are served."""

    RAY_OPTIONS = {"max_concurrency": 256}  # control calls (sleep, sync, ...) beside the run() loop

    def __init__(self, generator_cfg: Any, model_cfg: Any, model_path: str, *, reclaim_idle_s: float = 30.0,
                 stream_high_water: int = 4096, colocated: bool = False, device_ids: list[int] | None = None):
        from actors.engines.base import DeferredEngine, set_visible_devices
        from actors.engines.registry import make_engine

        if device_ids is not None:
            set_visible_devices(device_ids, generator_cfg)

        # Restarted by Ray after a crash: the engine holds the initial weights, not the run's
        # current ones. Serve nothing until the coordinator has synced us (see health()).
        import ray

        self.reconstructed = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self.reconstructed and colocated:
            # The learner may be training on our GPU right now: build the engine only when the
            # coordinator wakes us (heal_generators during generation, or the step's wake).
            engine = DeferredEngine(lambda: make_engine(generator_cfg, model_cfg, model_path))
        else:
            engine = make_engine(generator_cfg, model_cfg, model_path)
        if not colocated and getattr(generator_cfg, "partial_rollouts", False) and hasattr(engine, "enable_partial"):
            engine.enable_partial()  # vLLM: streaming per-sample requests it can interrupt and resubmit
        self.gen = Generator(engine, generator_cfg, reclaim_idle_s=reclaim_idle_s, stream_high_water=stream_high_water)
        self.needs_weights = self.reconstructed
        self._weights_ready = asyncio.Event()
        if not self.needs_weights:
            self._weights_ready.set()
        self._broadcast = None  # nccl transport: our rank of the learner's group, and its rendezvous
        self._broadcast_rdv = None

    def _weights_loaded(self) -> None:
        self.needs_weights = False
        self._weights_ready.set()

    def __repr__(self) -> str:  # the Ray dashboard's Repr column: live state
        gen = getattr(self, "gen", None)  # Ray may ask before __init__ ends
        if gen is None:
            return "GeneratorShell(starting)"
        st = gen.stats()
        return (f"GeneratorShell({gen.generator_id or '?'}: version {gen.engine.version}, "
                f"{int(st['generator_inflight_prompts'])} in flight, {int(st['generator_groups_published'])} groups "
                f"published{', paused' if st['generator_paused'] else ''})")

    async def run(self, redis_url: str, run_id: str, generator_id: str) -> None:
        from observe.logs import setup_actor_logging

        setup_actor_logging(generator_id)
        log.info("generator.started", generator_id=generator_id, pid=__import__("os").getpid())
        await self._weights_ready.wait()  # a restarted generator waits for the current weights
        from observe.ray_metrics import export_periodically

        exporter = asyncio.create_task(export_periodically(generator_id, self.gen.stats))
        try:
            await self.gen.run(redis_url, run_id, generator_id)
        finally:
            exporter.cancel()

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def health(self) -> dict:
        """What the coordinator checks between and during steps to resync a restarted generator."""
        import os

        return {"pid": os.getpid(), "version": self.gen.version, "needs_weights": self.needs_weights,
                "reconstructed": self.reconstructed, "engine_built": getattr(self.gen.engine, "built", True)}

    async def pause(self, interrupt: bool = False) -> int:
        return await self.gen.pause(interrupt)

    async def resume(self) -> None:
        self.gen.resume()

    async def stop(self) -> None:
        self.gen.stop()

    async def abort(self) -> None:
        self.gen.abort()

    async def close(self) -> None:
        """The run's end, after stop(): the engine shuts down (vLLM's engine core process exits) and the
        episode executor's query processes end."""
        self.gen.close_episodes()
        await self.gen.engine.close()

    async def sleep(self, level: int) -> None:
        await self.gen.sleep(level)

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.gen.wake(tags)

    async def load_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        await self.gen.load_weights(named_tensors, version)

    async def finish_weight_update(self, version: int) -> None:
        await self.gen.finish_weight_update(version)
        self._weights_loaded()

    async def set_version(self, version: int) -> None:
        self.gen.set_version(version)

    async def stats(self) -> dict[str, float]:
        return self.gen.stats()

    async def weight_sync_ranks(self) -> int:
        """Ranks this generator takes in the nccl group, from `rank` given to weight_sync_join on."""
        return self.gen.engine.weight_sync_ranks()

    async def weight_sync_join(self, rendezvous: Any, rank: int) -> None:
        """nccl transport: joins the learner's private group (concurrently with every other rank).
        An engine with its own workers (vLLM) joins from each worker, as ranks rank, rank+1, ..."""
        from weights.broadcast import BroadcastReceiver

        old, self._broadcast, self._broadcast_rdv = self._broadcast, None, None
        if old is not None and old != "engine":
            try:
                old.close()
            except Exception as e:  # noqa: BLE001 - a broken group; the new one replaces it anyway
                log.warning("closing the previous weight-sync group failed: %s", one_line(e))
        if self.gen.engine.loads_in_workers:
            await self.gen.engine.join_weight_group(rendezvous, rank)
            self._broadcast, self._broadcast_rdv = "engine", rendezvous
            return
        receiver = BroadcastReceiver(self.gen.load_weights)
        await asyncio.to_thread(receiver.init, rendezvous, rank)
        self._broadcast, self._broadcast_rdv = receiver, rendezvous

    async def weight_sync_group(self) -> Any:
        """The rendezvous of the group we joined; None after a restart (the coordinator rebuilds)."""
        return self._broadcast_rdv

    async def weight_sync_broadcast_receive(self, version: int) -> int:
        """One sync, concurrently with the learner's weight_sync_broadcast and the other ranks'."""
        if self._broadcast is None:
            raise RuntimeError("weight_sync_broadcast_receive: this generator is in no weight-sync group "
                               "(restarted?); weight_sync_join first")
        if self._broadcast == "engine":
            got = await self.gen.engine.receive_weight_group(version)
        else:
            got = await self._broadcast.receive_all(version)
        await self.gen.finish_weight_update(got)
        self._weights_loaded()
        return got

    async def weight_sync_receive(self, message: Any, kind: str = "object_store", impl: str = "ours") -> int | None:
        """One bucket (or the closing summary) of a bucketed sync; the receiver half comes from the
        one factory (weights.strategy)."""
        in_workers = self.gen.engine.loads_in_workers
        if getattr(self, "_receiver_kind", None) != (kind, impl, in_workers):
            from weights.strategy import get_transport

            transport = get_transport(kind, impl)
            self._receiver = transport.make_receiver(self.gen.load_weights, self.gen.engine if in_workers else None)
            self._receiver_kind = (kind, impl, in_workers)
        version = await self._receiver.receive(message)
        if version is not None:
            await self.gen.finish_weight_update(version)
            self._weights_loaded()
        return version


def __getattr__(name: str):
    if name == "GeneratorActor":  # Ray's actor class, made on first use (importing this module imports no Ray)
        from actors.shell import ray_actor

        return ray_actor(GeneratorShell)
    raise AttributeError(name)
