"""The coordinator's weight-sync handshake: learner -> generators, and resyncing restarted generators.

`WeightSync` is a component the coordinator holds (actors/coordinator/coordinator.py), built from what it
uses: the coordinator's config section, the learner's and the generators' typed handles (actors/handles.py)
and a log.

Invariants:
- The coordinator never touches tensors, and knows no transport's steps: it picks the transport from
  the config (weights.strategy, the one factory) and hands it a `weights.Link` of the two verbs, the
  learner's `send_weights` and each generator's `receive_weights`, called as methods of their handles
  (Ray actor methods, or plain methods in tests), never by name. The transport checks every receiver
  reports the version it was sent.
- A failed sync (a generator died mid-sync; Ray restarts it) is redone from bucket 0, a bounded
  number of times with backoff; a collective transport's group (`group`, kept between syncs) is
  rebuilt whole before the next attempt. Before it, a generator whose engine is not built (Ray restarted
  it colocated: a DeferredEngine, and the step's wake(["weights"]) went to its dead predecessor) is woken
  (CI's chaos run: a generator killed during step 6's sync failed all 5 attempts with EngineAsleep).
- A generator Ray restarted (initial weights, or another version) gets the current version alone,
  through the object store (`weights.strategy.fallback`) when the transport is collective, while the
  others keep generating.
- Every call is bounded (actors/handles.py): the health check by HEALTH_TIMEOUT_S (a generator still
  restarting is tried again next round), every other call and each sync step of either side by
  coordinator.call_timeout_s. A sync step past its bound is not redone: a frozen actor does not thaw by
  retrying; ActorCallTimeout goes to the launcher like a death.
- A generator's silence is never silent here, nor unbounded: the first health check it does not answer
  (Ray restarting it after its process died, frozen, or overloaded) is a warning naming it and the error,
  its answer again an info line with how long it was silent. Silent past coordinator.call_timeout_s it is
  restarted in place once (GeneratorPool.restart_in_place, the frozen path); silent past twice that again,
  heal raises ActorCallTimeout naming `generator-<i>.health`, which ends the run as a death does. A restart
  the heartbeat made meanwhile counts as that one restart (GeneratorPool.restarted_at): the clock starts
  again from it, and the next step is the ActorCallTimeout. (The GPU
  run of 2026-12-05: the engine's memory went 15 s after the last async sync, mid-evaluation, and the
  coordinator then waited 39 s with nothing logged.)
- A generator whose engine died under it (vLLM's engine core: health's `engine_dead`) is restarted in place,
  with a warning naming it and the engine's error: left alone it would fail every group it takes.
- `last_sync_bytes` is what the last sync's sender moved (its SyncSummary; NaN where a collective transport
  shows none): the step logs it as `weight_sync_bytes` (with learner.lora, the adapter's bytes).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.handles import GeneratorPool, LearnerHandle
from actors.shell import ActorCallTimeout
from config import CoordinatorConfig
from queues.errors import one_line
from weights.protocol import Link

HEALTH_TIMEOUT_S = 2.0  # a generator's health answer; one still restarting (or frozen) is asked next round


class WeightSync:
    """sync / load / heal: the learner's weights into the generators."""

    def __init__(self, cfg: CoordinatorConfig, learner: LearnerHandle, generators: GeneratorPool, log: Any = None):
        self.cfg, self.learner, self.generators, self.log = cfg, learner, generators, log
        self.group = None  # nccl: the rendezvous of the group every generator joined
        self.resyncs = 0  # generators resynced by heal (saved with the cursor)
        self.last_sync_bytes = float("nan")  # what the last sync's sender moved (its SyncSummary)
        self._silence: dict[str, list] = {}  # generator label -> [silent since (monotonic), restarted in place]

    async def heal(self, version: int, timeout_s: float = HEALTH_TIMEOUT_S) -> int:
        """Finds generators that lost their weights (restarted by Ray after a crash: initial
        weights, or a version other than ours) and syncs `version` into them alone.
        Returns how many were resynced; a generator still restarting is tried next time."""
        async def check(g):
            try:
                h = await self.generators.health(g, timeout_s)
            except Exception as e:  # noqa: BLE001 - still restarting (or frozen): said, bounded, next round
                self._silent(g, e, timeout_s)
                return False
            self._answered(g)
            if h is None:
                return False
            if h.get("engine_dead"):
                self._engine_dead(g, str(h["engine_dead"]))
                return False
            return bool(h["needs_weights"]) or int(h["version"]) != version
        flags = await asyncio.gather(*(check(g) for g in self.generators.actors))
        lagging = [g for g, f in zip(self.generators.actors, flags) if f]
        if not lagging:
            return 0
        if self.log is not None:
            self.log.warning("resyncing restarted generators", count=len(lagging), version=version)
        self.resyncs += len(lagging)
        try:
            await self.load(version, targets=lagging, attempts=1)
            await self.generators.resume(targets=lagging)
        except Exception as e:  # noqa: BLE001 - it died again mid-sync: next round
            if self.log is not None:
                self.log.warning("generator resync failed; retrying", error=str(e).splitlines()[0][:200])
            return 0
        return len(lagging)

    def _silent(self, g: Any, error: BaseException, timeout_s: float) -> None:
        """A health check `g` did not answer: a warning the first time, a restart in place past
        coordinator.call_timeout_s of silence, ActorCallTimeout past twice that again (module invariant)."""
        label, now = self.generators.label(g), time.monotonic()
        entry = self._silence.get(label)
        restarted = self.generators.restarted_at(g)
        if entry is None:
            self._silence[label] = entry = [now, False]
            if self.log is not None:
                self.log.warning("generator not answering its health call (restarting, frozen or dead)",
                                 generator=label, call="health", error=one_line(error))
            if restarted >= now - timeout_s:
                entry[:] = [restarted, True]  # restarted during the check (the heartbeat): that was the one restart
        elif restarted > entry[0]:
            entry[:] = [restarted, True]  # restarted since (the heartbeat): the new instance's clock, once
        silent, bound = now - entry[0], self.generators.control_s * (2 if entry[1] else 1)
        if silent <= bound:
            return
        timeout = ActorCallTimeout.of(f"{label}.health", round(silent, 1))
        if not entry[1] and self.generators.restart_in_place(g, "health", str(timeout)):
            entry[:] = [now, True]
            return
        raise timeout

    def _answered(self, g: Any) -> None:
        label = self.generators.label(g)
        entry = self._silence.pop(label, None)
        if entry is not None and self.log is not None:
            self.log.info("generator answering again", generator=label, silent_s=round(time.monotonic() - entry[0], 1),
                          restarted_in_place=entry[1])

    def _engine_dead(self, g: Any, error: str) -> None:
        if not self.generators.restart_in_place(g, "health", error, event="generator's engine died: restarted in place"):
            raise RuntimeError(f"{self.generators.label(g)}: its engine died ({error}) and it cannot be restarted here")

    async def initial(self, version: int, warm_start_metrics: dict[str, float]) -> None:
        """Before the first step. Colocated, the learner goes to sleep first (optimizer state to the host
        where configured, its cache emptied), as it is between steps, so step 1 generates beside a sleeping
        learner, not an awake one. After a warm start (which ran with colocated engines asleep) the
        generators hold the initial weights: wake them (colocated: they slept through the warm start; async
        engines never sleep, on GPUs of their own or sharing the learner's), give them `version`, let them
        pull again."""
        colocated = self.cfg.mode == "colocated"
        if colocated:
            await self.learner.sleep()
        if not warm_start_metrics:
            return
        if self.log is not None:
            self.log.info("warm-start done", **{k: round(v, 4) for k, v in warm_start_metrics.items()})
        await self.load(version, wake=colocated)
        await self.generators.resume()  # sleep paused them

    async def load(self, version: int, targets: list | None = None, attempts: int = 5, wake: bool = True) -> None:
        """Engines that dropped their weights (asleep at level 2, restarted, fresh) get `version`: wake their
        weights (`wake`), sync, set the version, wake their KV cache (`wake`). They do not resume pulling."""
        if wake:
            await self.generators.wake(["weights"], targets=targets)
        await self.sync(version, targets=targets, attempts=attempts)
        await self.generators.set_version(version, targets=targets)
        if wake:
            await self.generators.wake(["kv_cache"], targets=targets)

    async def sync(self, version: int, targets: list | None = None, attempts: int = 5) -> float:
        """Learner -> every generator (or `targets`), bucket by bucket; returns seconds taken.
        A sync that fails (a generator died mid-sync; Ray restarts it) is redone from bucket 0; one
        whose step ran past its bound (a frozen actor) is not."""
        start = time.perf_counter()
        for attempt in range(attempts):
            try:
                await self._sync_once(version, self.generators.actors if targets is None else targets)
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
                await self._wake_unbuilt(self.generators.actors if targets is None else targets)
        return time.perf_counter() - start

    async def _wake_unbuilt(self, generators: list) -> None:
        """Wakes the weights of the generators whose engine is not built (restarted colocated: module
        invariant); one still restarting (no health answer in HEALTH_TIMEOUT_S) is asked again next attempt."""
        async def unbuilt(g) -> bool:
            try:
                h = await self.generators.health(g, HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still restarting: the next attempt asks again
                return False
            return h is not None and not h.get("engine_built", True)
        flags = await asyncio.gather(*(unbuilt(g) for g in generators))
        rebuilt = [g for g, f in zip(generators, flags) if f]
        if rebuilt:
            if self.log is not None:
                self.log.warning("waking restarted generators before the sync is redone",
                                 generators=[self.generators.label(g) for g in rebuilt])
            await self.generators.wake(["weights"], targets=rebuilt)

    async def _sync_once(self, version: int, generators: list) -> None:
        from weights.strategy import fallback, transport_for

        transport = transport_for(self.cfg)
        collective = not transport.per_bucket
        if collective and len(generators) < len(self.generators):
            # A collective needs every rank of the group: resyncing only some generators (a
            # restarted one, from heal) goes through the object store instead, so the
            # others keep generating. The next full sync rebuilds the group with the newcomer.
            transport, collective = fallback(), False
        link = Link(self.learner.sender(), self.generators.receivers(generators),
                    group=self.group if collective else None, log=self.log)
        try:
            await transport.sync(link, version, self.cfg.weight_bucket_mb)
        finally:
            if collective:
                self.group = link.group
        # Bytes the learner sent (with learner.lora: the adapter's alone), a scalar of every step that synced
        self.last_sync_bytes = float(link.summary.nbytes) if link.summary is not None else float("nan")
