"""GeneratorShell: the thin Ray shell (an async actor; `GeneratorActor` is its Ray class) over one
actors.generator.generator.Generator, built like every actor (actors/shell.py): its config section,
the run's RunContext (Redis URL, stream settings, logging) and its own model, id and GPU ids.

Invariants:
- It takes the node-local GPU ids of its engine's bundles (`device_ids`, from the placement) and
  sets CUDA_VISIBLE_DEVICES to exactly those before the engine is built, so an engine's
  tensor-parallel workers land on them.
- Weight sync is one verb, `receive_weights(call)`, forwarded to this generator's end of the
  transport (weights.endpoint.ReceiveEnd): the transport decides what reaches the engine (messages
  as they came when its weights live in its own workers, vLLM; tensors through `load_weights`
  otherwise). When a whole sync has arrived the shell ends the engine's update and serves again.
- A generator Ray restarted serves nothing until the coordinator has synced it (`health()`), and says it
  was restarted (a warning in its log, before its engine is built).
- `health()` answers without touching the engine's work: its version, whether it needs weights, and
  `engine_dead` (Engine.dead: its engine can serve nothing more; the coordinator then restarts it).
- `ping` (the coordinator's heartbeat) is served in its own concurrency group (HEARTBEAT_GROUP), so it
  is answered while the generator generates or its main event loop is blocked.
"""
from __future__ import annotations

import asyncio
from typing import Any

import structlog

from actors.generator.generator import Generator
from actors.shell import RESTARTABLE, built_with_gc_paused
from config import GeneratorConfig, ModelConfig, RunContext
from observe.logs import setup_actor_logging

log = structlog.get_logger("arctic_rl.generator")

HEARTBEAT_GROUP = "heartbeat"  # the Ray concurrency group that serves `ping` alone


class GeneratorShell:
    """Async Ray actor over one Generator; run() loops while control calls are served."""

    # Control calls (sleep, sync, ...) beside the run() loop; restarted by Ray after a crash (it then
    # serves nothing until synced, and its run() retried takes back the tasks it held).
    # `ping` (the coordinator's heartbeat) in a group of its own: a thread and event loop apart from the calls
    # above, so a generator whose main loop is busy still answers it.
    RAY_OPTIONS = {"max_concurrency": 256, "concurrency_groups": {HEARTBEAT_GROUP: 1}, **RESTARTABLE}

    @built_with_gc_paused
    def __init__(self, generator_cfg: GeneratorConfig, ctx: RunContext | None = None, *, model_cfg: ModelConfig, model_path: str,
                 generator_id: str = "generator-0", colocated: bool = False, device_ids: list[int] | None = None):
        from actors.engines.base import DeferredEngine, set_visible_devices
        from actors.engines.registry import make_engine

        self.ctx = ctx or RunContext()
        self.generator_id = generator_id
        setup_actor_logging(generator_id, self.ctx)
        if device_ids is not None:
            set_visible_devices(device_ids, generator_cfg)

        # Restarted by Ray after a crash: the engine holds the initial weights, not the run's
        # current ones. Serve nothing until the coordinator has synced us (see health()).
        import ray

        self.reconstructed = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self.reconstructed:  # the previous instance's process died (its cause: Ray's worker logs of that pid)
            log.warning("generator.restarted_by_ray", generator_id=generator_id, pid=__import__("os").getpid())
        if self.reconstructed and colocated:
            # The learner may be training on our GPU right now: build the engine only when the
            # coordinator wakes us (WeightSync.heal during generation, or the step's wake).
            engine = DeferredEngine(lambda: make_engine(generator_cfg, model_cfg, model_path))
        else:
            engine = make_engine(generator_cfg, model_cfg, model_path)
        if not colocated and generator_cfg.partial_rollouts:
            engine.enable_partial()  # vLLM: streaming per-sample requests it can interrupt and resubmit
        self.gen = Generator(engine, generator_cfg, reclaim_idle_s=self.ctx.reclaim_idle_s,
                             stream_high_water=self.ctx.stream_high_water)
        self.needs_weights = self.reconstructed
        self._weights_ready = asyncio.Event()
        if not self.needs_weights:
            self._weights_ready.set()
        from weights.endpoint import ReceiveEnd

        self._weights_in = ReceiveEnd(self.gen.load_weights, lambda: self.gen.engine)

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

    async def run(self) -> None:
        """The consumer loop until stop(), over the run's streams (ctx)."""
        from observe.ray_metrics import export_periodically

        log.info("generator.started", generator_id=self.generator_id, pid=__import__("os").getpid())
        await self._weights_ready.wait()  # a restarted generator waits for the current weights
        exporter = asyncio.create_task(export_periodically(self.generator_id, self.gen.stats))
        try:
            await self.gen.run(self.ctx.redis_url, self.ctx.run_id, self.generator_id)
        finally:
            exporter.cancel()

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def ping(self) -> int:
        """The coordinator's heartbeat (actors/coordinator/heartbeat.py): answered from HEARTBEAT_GROUP's own
        thread and event loop, so generation, a weight load or a blocked main loop does not delay it."""
        import os

        return os.getpid()

    # Ray's @ray.method(concurrency_group=...) sets this attribute; set here so importing the shell imports no Ray.
    ping.__ray_concurrency_group__ = HEARTBEAT_GROUP  # type: ignore[attr-defined]

    async def health(self) -> dict:
        """What the coordinator checks between and during steps to resync a restarted generator."""
        import os

        return {"pid": os.getpid(), "version": self.gen.version, "needs_weights": self.needs_weights,
                "reconstructed": self.reconstructed, "engine_built": getattr(self.gen.engine, "built", True),
                "engine_dead": self.gen.engine.dead()}

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

    async def memory(self) -> dict[str, float]:
        """Its engine's device memory (GiB, peaks since the last call; {} on CPU)."""
        return await self.gen.engine.memory()

    async def receive_weights(self, call: Any) -> Any:
        """One step of a weight sync (a weights.WeightsCall from the coordinator); a step that completes
        a sync ends the engine's update under its version."""
        reply, completed = await self._weights_in.handle(call)
        if completed is not None:
            await self.gen.finish_weight_update(completed)
            self._weights_loaded()
        return reply


def __getattr__(name: str):
    if name == "GeneratorActor":  # Ray's actor class, made on first use (importing this module imports no Ray)
        from actors.shell import ray_actor

        return ray_actor(GeneratorShell)
    raise AttributeError(name)
