"""The coordinator's weight-sync handshake: learner -> generators, and resyncing restarted generators.

A mixin of `actors.coordinator.coordinator.Coordinator` (kept apart so the step loop reads on its own). It uses
the coordinator's `cfg`, `learner`, `generators`, `version`, `log` and `_broadcast_rdv`.

Invariants:
- The coordinator never touches tensors: it drives the transport bucket by bucket
  (weights/__init__.py) and checks every receiver reports the version it was sent.
- A failed sync (a generator died mid-sync; Ray restarts it) is redone from bucket 0, a bounded
  number of times with backoff; an NCCL group is rebuilt whole before the next attempt.
- A generator Ray restarted (initial weights, or another version) gets the current version alone,
  through the object store, while the others keep generating.
"""
from __future__ import annotations

import asyncio
import time

from actors.shell import call


class WeightSyncHandshake:
    """sync_weights / heal_generators / initial_sync for the Coordinator."""

    async def heal_generators(self, timeout_s: float = 2.0) -> int:
        """Finds generators that lost their weights (restarted by Ray after a crash: initial
        weights, or a version other than ours) and syncs the current version into them alone.
        Returns how many were resynced; a generator still restarting is tried next time."""
        async def check(g):
            if not hasattr(g, "health"):
                return False
            try:
                h = await asyncio.wait_for(call(g, "health"), timeout_s)
            except Exception:  # noqa: BLE001 - still restarting: next round
                return False
            return bool(h["needs_weights"]) or int(h["version"]) != self.version
        flags = await asyncio.gather(*(check(g) for g in self.generators))
        lagging = [g for g, f in zip(self.generators, flags) if f]
        if not lagging:
            return 0
        if self.log is not None:
            self.log.warning("resyncing restarted generators", count=len(lagging), version=self.version)
        self.resyncs = getattr(self, "resyncs", 0) + len(lagging)
        try:
            await asyncio.gather(*(call(g, "wake", ["weights"]) for g in lagging))
            await self.sync_weights(self.version, targets=lagging, attempts=1)
            await asyncio.gather(*(call(g, "set_version", self.version) for g in lagging))
            await asyncio.gather(*(call(g, "wake", ["kv_cache"]) for g in lagging))
            await asyncio.gather(*(call(g, "resume") for g in lagging))
        except Exception as e:  # noqa: BLE001 - it died again mid-sync: next round
            if self.log is not None:
                self.log.warning("generator resync failed; retrying", error=str(e).splitlines()[0][:200])
            return 0
        return len(lagging)

    async def _all_generators(self, method: str, *args) -> list:
        return await asyncio.gather(*(call(g, method, *args) for g in self.generators))

    async def sync_weights(self, version: int, targets: list | None = None, attempts: int = 5) -> float:
        """Learner -> every generator (or `targets`), bucket by bucket; returns seconds taken.
        A sync that fails (a generator died mid-sync; Ray restarts it) is redone from bucket 0."""
        start = time.perf_counter()
        for attempt in range(attempts):
            try:
                await self._sync_once(version, self.generators if targets is None else targets)
                return time.perf_counter() - start
            except Exception as e:  # noqa: BLE001
                if attempt + 1 >= attempts:
                    raise
                if self.log is not None:
                    self.log.warning("weight sync failed; redoing it", version=version, attempt=attempt + 1,
                                     error=str(e).splitlines()[0][:200])
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
        return time.perf_counter() - start

    async def _sync_once(self, version: int, generators: list) -> None:
        from weights import drive_bucketed_sync

        kind = self.cfg.coordinator.weight_sync
        if kind == "nccl" and len(generators) < len(self.generators):
            # A broadcast needs every rank of the group: resyncing only some generators (a
            # restarted one, from heal_generators) goes through the object store instead, so the
            # others keep generating. The next full sync rebuilds the group with the newcomer.
            kind = "object_store"
        if kind in ("object_store", "cuda_ipc"):
            impl = getattr(self.cfg.coordinator, "weight_sync_impl", "ours") if kind == self.cfg.coordinator.weight_sync \
                else "ours"  # a partial resync's object-store fallback is ours
            await call(self.learner, "weight_sync_start", version, kind, self.cfg.coordinator.weight_bucket_mb, impl)
            got = [await drive_bucketed_sync(
                lambda: call(self.learner, "weight_sync_next"),
                [lambda msg, g=g: call(g, "weight_sync_receive", msg, kind, impl) for g in generators],
                abort=lambda: call(self.learner, "weight_sync_abort"))]
        else:  # nccl (gloo on CPU): a private group of the learner (rank 0) and every generator
            await self._broadcast_group()
            try:
                got = await asyncio.gather(call(self.learner, "weight_sync_broadcast", version),
                                           *(call(g, "weight_sync_broadcast_receive", version)
                                             for g in generators))
            except BaseException:
                self._broadcast_rdv = None  # a rank may be gone or the group broken: rebuild it first
                raise
        if any(v != version for v in got):
            raise RuntimeError(f"weight sync finished at versions {got}, expected {version}")

    async def _broadcast_group(self) -> None:
        """nccl: builds the learner's private group with every generator, on the first sync and
        again whenever a generator is not a member of it (Ray restarted it) or a sync failed.
        Every rank must join at once, so the group is always rebuilt whole."""
        rdv = self._broadcast_rdv
        if rdv is not None:
            joined = await asyncio.gather(*(call(g, "weight_sync_group") for g in self.generators))
            if all(j == rdv for j in joined):
                return
        from weights import group_layout

        self._broadcast_rdv = None
        # A generator whose engine loads in k workers (vLLM, tensor parallelism k) takes k ranks.
        firsts, world = group_layout(await asyncio.gather(*(call(g, "weight_sync_ranks") for g in self.generators)))
        rdv = await call(self.learner, "weight_sync_listen", world, self.cfg.coordinator.weight_bucket_mb)
        await asyncio.gather(call(self.learner, "weight_sync_init"),
                             *(call(g, "weight_sync_join", rdv, first) for first, g in zip(firsts, self.generators)))
        self._broadcast_rdv = rdv
        if self.log is not None:
            self.log.info("weight-sync group built", backend=rdv.backend, world_size=rdv.world_size,
                          host=rdv.host, port=rdv.port)

    async def initial_sync(self, warm_start_metrics: dict[str, float]) -> None:
        """Before the first step. Colocated, the learner goes to sleep first (optimizer state to the host
        where configured, its cache emptied), as it is between steps, so step 1 generates beside a sleeping
        learner, not an awake one. After a warm start (which ran with colocated engines asleep) the
        generators hold the initial weights: wake them, give them version 0, let them pull again."""
        if self.cfg.coordinator.mode == "colocated":
            await call(self.learner, "sleep")
        if not warm_start_metrics:
            return
        if self.log is not None:
            self.log.info("warm-start done", **{k: round(v, 4) for k, v in warm_start_metrics.items()})
        await self._all_generators("wake", ["weights"])
        await self.sync_weights(self.version)
        await self._all_generators("set_version", self.version)
        await self._all_generators("wake", ["kv_cache"])
        await self._all_generators("resume")  # sleep paused them
