"""The coordinator's weight-sync handshake: learner -> generators, and resyncing restarted generators.

A mixin of `actors.coordinator.coordinator.Coordinator` (kept apart so the step loop reads on its own). It uses
the coordinator's `cfg`, `learner`, `generators`, `version`, `log`, `_broadcast_rdv` and its bounded calls
(actors/coordinator/bounds.py BoundedCalls).

Invariants:
- The coordinator never touches tensors, and knows no transport's steps: it picks the transport from
  the config (weights.strategy, the one factory) and hands it a `weights.Link` of the two verbs, the
  learner's `send_weights` and each generator's `receive_weights`, called as methods of their handles
  (Ray actor methods, or plain methods in tests), never by name. The transport checks every receiver
  reports the version it was sent.
- A failed sync (a generator died mid-sync; Ray restarts it) is redone from bucket 0, a bounded
  number of times with backoff; a collective transport's group (`_broadcast_rdv`, kept between
  syncs) is rebuilt whole before the next attempt.
- A generator Ray restarted (initial weights, or another version) gets the current version alone,
  through the object store (`weights.strategy.fallback`) when the transport is collective, while the
  others keep generating.
- `last_sync_bytes` is what the last sync's sender moved (its SyncSummary; NaN where a collective transport
  shows none): run_step logs it as the step's `weight_sync_bytes` (with learner.lora, the adapter's bytes).
- Every call is bounded (actors/coordinator/bounds.py): the health check by HEALTH_TIMEOUT_S (a
  generator still restarting is tried again next round), every other call and each sync step of
  either side by coordinator.call_timeout_s. A sync step past its bound is not redone: a frozen actor
  does not thaw by retrying; ActorCallTimeout goes to the launcher like a death.
"""
from __future__ import annotations

import asyncio
import time

from actors.coordinator.bounds import bounded_verb, call_bound
from actors.shell import ActorCallTimeout, await_within
from weights.base import maybe_await
from weights.protocol import Link, verb

HEALTH_TIMEOUT_S = 2.0  # a generator's health answer; one still restarting (or frozen) is asked next round


class WeightSyncHandshake:
    """sync_weights / heal_generators / initial_sync for the Coordinator."""

    async def heal_generators(self, timeout_s: float = HEALTH_TIMEOUT_S) -> int:
        """Finds generators that lost their weights (restarted by Ray after a crash: initial
        weights, or a version other than ours) and syncs the current version into them alone.
        Returns how many were resynced; a generator still restarting is tried next time."""
        async def check(g):
            if not hasattr(g, "health"):
                return False
            try:
                h = await await_within(maybe_await(verb(g.health)()), timeout_s, f"{self.generator_label(g)}.health")
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
            await self._all_generators("wake", ["weights"], targets=lagging)
            await self.sync_weights(self.version, targets=lagging, attempts=1)
            await self._all_generators("set_version", self.version, targets=lagging)
            await self._all_generators("wake", ["kv_cache"], targets=lagging)
            await self._all_generators("resume", targets=lagging)
        except Exception as e:  # noqa: BLE001 - it died again mid-sync: next round
            if self.log is not None:
                self.log.warning("generator resync failed; retrying", error=str(e).splitlines()[0][:200])
            return 0
        return len(lagging)

    async def sync_weights(self, version: int, targets: list | None = None, attempts: int = 5) -> float:
        """Learner -> every generator (or `targets`), bucket by bucket; returns seconds taken.
        A sync that fails (a generator died mid-sync; Ray restarts it) is redone from bucket 0; one
        whose step ran past its bound (a frozen actor) is not."""
        start = time.perf_counter()
        for attempt in range(attempts):
            try:
                await self._sync_once(version, self.generators if targets is None else targets)
                return time.perf_counter() - start
            except ActorCallTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                if attempt + 1 >= attempts:
                    raise
                if self.log is not None:
                    self.log.warning("weight sync failed; redoing it", version=version, attempt=attempt + 1,
                                     error=str(e).splitlines()[0][:200])
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
        return time.perf_counter() - start

    async def _sync_once(self, version: int, generators: list) -> None:
        from weights.strategy import fallback, transport_for

        transport = transport_for(self.cfg.coordinator)
        collective = not transport.per_bucket
        if collective and len(generators) < len(self.generators):
            # A collective needs every rank of the group: resyncing only some generators (a
            # restarted one, from heal_generators) goes through the object store instead, so the
            # others keep generating. The next full sync rebuilds the group with the newcomer.
            transport, collective = fallback(), False
        send = bounded_verb(verb(self.learner.send_weights), call_bound(self.cfg, "learner", "send_weights"),
                            "learner.send_weights")
        receivers = [bounded_verb(verb(g.receive_weights), call_bound(self.cfg, "generator", "receive_weights"),
                                  f"{self.generator_label(g)}.receive_weights") for g in generators]
        link = Link(send, receivers, group=self._broadcast_rdv if collective else None, log=self.log)
        try:
            await transport.sync(link, version, self.cfg.coordinator.weight_bucket_mb)
        finally:
            if collective:
                self._broadcast_rdv = link.group
        # Bytes the learner sent (with learner.lora: the adapter's alone), a scalar of every step that synced
        self.last_sync_bytes = float(link.summary.nbytes) if link.summary is not None else float("nan")

    async def initial_sync(self, warm_start_metrics: dict[str, float]) -> None:
        """Before the first step. Colocated, the learner goes to sleep first (optimizer state to the host
        where configured, its cache emptied), as it is between steps, so step 1 generates beside a sleeping
        learner, not an awake one. After a warm start (which ran with colocated engines asleep) the
        generators hold the initial weights: wake them (colocated: they slept through the warm start; async
        engines never sleep, on GPUs of their own or sharing the learner's), give them version 0, let them
        pull again."""
        colocated = self.cfg.coordinator.mode == "colocated"
        if colocated:
            await self._learner("sleep")
        if not warm_start_metrics:
            return
        if self.log is not None:
            self.log.info("warm-start done", **{k: round(v, 4) for k, v in warm_start_metrics.items()})
        if colocated:
            await self._all_generators("wake", ["weights"])
        await self.sync_weights(self.version)
        await self._all_generators("set_version", self.version)
        if colocated:
            await self._all_generators("wake", ["kv_cache"])
        await self._all_generators("resume")  # sleep paused them
