"""Coordinator: the step loop, the policy version, the data cursor, the handshakes, checkpoints.

One step, colocated (shared/DESIGN.md):
  1. publish the step's prompts; generators run them while scorers score finished groups
  2. every group generated -> generator.sleep(level)           (the scoring tail still runs)
  3. learner.wake -> learner.train(step) -> learner.sleep      (after the assembler's batch)
  4. generator.wake(["weights"]) -> weight sync -> generator.wake(["kv_cache"]) -> version + 1
Async mode skips the sleeps: the next step's prompts are already generating while this step
trains, at most `max_staleness` versions behind; at the boundary generators pause (with
`generator.partial_rollouts`, their engines park in-flight requests instead of finishing them),
take the new weights and resume (parked requests continue under the new weights).

Invariants:
- Control calls are awaited in order; a step's handshake never interleaves with another's.
- Every call to an actor has a bound (actors/handles.py): one past it (a frozen actor) raises
  ActorCallTimeout naming the actor and the call, and the run ends as on a death (relaunch or one line);
  a frozen generator is first restarted in place, once a call (GeneratorPool), at the latest when a step's
  groups are late (its restarted instance then serves them in that step: _wait_generated); the heartbeat
  (heartbeat.py, running while run() runs) restarts one that misses its pings within ~15 s.
- Every task the coordinator publishes gets exactly one outcome in the ledger (trained or a
  drop reason), and the per-step counts are in the step's metrics. The ledger is the one record that
  grows with the run; everything else the coordinator holds covers the last few steps (a step's
  metrics go to metrics.jsonl, never kept; tests/integration/test_memory_bounds.py).
- The coordinator never touches tensors: weights move learner -> generators through
  weights, driven bucket by bucket from here.
- A checkpoint holds the learner's state and this cursor (step, version, epoch, position); a
  resumed run continues at the next step with the same data order. A step's metrics row is written
  before its checkpoint becomes the latest, so no resume skips a step whose row is missing.
- Colocated, the learner is asleep before the first step (initial_sync) and the engines are asleep
  during the final checkpoint: the device never holds a resident engine and an awake learner at once
  (a mid-run checkpoint is the exception: the engines generate the next step while the learner saves).

It holds a typed handle per role it calls (actors/handles.py: `generators`, `learner`, `assembler`; every
call bounded there) and components built from them: `weights` (sync.py WeightSync: the sync handshake,
restarted generators resynced), `checkpoints` (checkpoint.py), `report` (report.py: where metrics go). Built
like every actor (actors/shell.py) over Ray actor handles or plain objects alike; its "generated" events are
read by `generated` (generated.py: the one consumer loop, queues.worker.Worker).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from actors.coordinator.checkpoint import Checkpoints, count_outcomes
from actors.coordinator.cursor import DataCursor
from actors.coordinator.generated import GeneratedEvents
from actors.coordinator.heartbeat import start_heartbeat, stop_heartbeat
from actors.coordinator.prompts import eval_tasks, train_tasks
from actors.coordinator.report import StepReport
from actors.coordinator.sync import WeightSync
from actors.handles import AssemblerHandle, CallBounds, GeneratorPool, LearnerHandle
from actors.shell import built_with_gc_paused
from config import RunConfig, RunContext
from observe.logs import setup_actor_logging
from queues.messages import PromptTask, codec


class Coordinator:
    """The step loop (this module's docstring) over its handles and components."""

    # The launcher's calls (attach_metrics, stats, stop) beside run(). Not restarted by Ray: it holds the
    # run's state, and a run that loses it is relaunched from its latest checkpoint.
    RAY_OPTIONS = {"max_concurrency": 8}

    @built_with_gc_paused
    def __init__(self, cfg: RunConfig, ctx: RunContext, train_items: list, eval_items: list,
                 *, generators: list, learner: Any, assembler: Any, metrics_logger=None, log=None):
        if cfg.coordinator.weight_sync == "auto":
            raise ValueError("Coordinator needs a validated config (config.validate resolves coordinator.weight_sync)")
        self.cfg, self.ctx = cfg, ctx
        self.run_id, self.run_dir = ctx.run_id, Path(ctx.run_dir)
        self.train_items, self.eval_items = train_items, eval_items
        # Its JSON log (logs/coordinator.jsonl) when the run has a directory; `log` stands in (tests).
        self.log = log if log is not None else setup_actor_logging("coordinator", ctx) if ctx.run_dir else None
        self.report = StepReport(cfg, ctx.run_id, self.run_dir, self.log, metrics_logger)
        bounds = CallBounds.of(cfg)
        self.generators = GeneratorPool(generators, bounds, log=self.log)
        self.learner, self.assembler = LearnerHandle(learner, bounds), AssemblerHandle(assembler, bounds)
        self.weights = WeightSync(cfg.coordinator, self.learner, self.generators, log=self.log)
        self.checkpoints = Checkpoints(cfg, ctx.run_id, self.run_dir, self.learner, log=self.log)
        self.step = 0
        self.version = 0
        self.cursor = DataCursor(len(train_items), cfg.data.shuffle_seed)
        self.ledger: dict[str, str] = {}  # task_id -> outcome, for every task ever published
        self.generated = GeneratedEvents()  # which tasks' groups are done (generated.py), consumed once connected
        self._stop = False
        self._cursor_before: dict[int, dict[str, int]] = {}  # step -> the cursor before its prompts were taken
        self._generators_resting = False
        self.conn = None  # the run's streams, once connected

    # -- streams -----------------------------------------------------------------------------

    async def connect(self) -> None:
        """The run's streams, and the events consumer in the background (generated.py)."""
        from queues.streams import RunStreams
        from queues.topology import DATA_FLOW, EVENTS, PROMPTS

        self.conn = await RunStreams.open(self.ctx.redis_url, self.run_id)
        hw = self.cfg.cluster.stream_high_water
        self.prompts = self.conn.stream(PROMPTS, high_water=hw)
        self.events = self.conn.stream(EVENTS, high_water=0)
        self.depth_streams = {spec.name: self.conn.stream(spec) for spec in DATA_FLOW}
        for s in (self.prompts, self.events, *self.depth_streams.values()):
            await s.ensure_group()
        self.generated.start(self.events, EVENTS.group, self.cfg.cluster.reclaim_idle_s)

    async def disconnect(self) -> None:
        """Stops the events consumer (within its read bound) and closes the run's connection."""
        await self.generated.stop()
        if self.conn is not None:
            await self.conn.close()

    async def _wait_generated(self, task_ids: list[str], timeout_s: float) -> float:
        """Returns when every task's group was published by a generator (event), or at timeout.
        Meanwhile resyncs any generator Ray restarted (it waits for the current weights). At the timeout with
        groups missing, a frozen generator is restarted in place (GeneratorPool.restart_frozen) and the wait made
        once more: its prompts are pending under its name, and the new instance, resynced here, serves them
        first (else the collect waited its whole timeout for them, and failed them)."""
        def heal():
            return self.weights.heal(self.version)

        last = await self.generated.wait(task_ids, timeout_s, heal)
        if self.generated.missing(task_ids) and await self.generators.restart_frozen():
            last = await self.generated.wait(task_ids, timeout_s, heal)
        return last

    def _tasks(self, step: int, indices: list[int], version: int, first_slot: int = 0) -> list[PromptTask]:
        return train_tasks(self.train_items, step, indices, version, self.cfg.generator.n_samples, first_slot)

    async def _publish(self, tasks: list[PromptTask]) -> list[str]:
        await self.prompts.publish_many([codec(PromptTask).encode(t) for t in tasks])
        return [t.task_id for t in tasks]

    async def _eval(self) -> dict[str, float]:
        if not self.eval_items:
            return {}
        start = time.perf_counter()
        timeout = self.cfg.coordinator.step_timeout_s
        self.report.phase(self.step, "evaluating", version=self.version)
        greedy_ids = await self._publish(eval_tasks(self.eval_items, self.step, self.version, "g", 1, {"temperature": 0.0}))
        sampled_ids = []
        if self.cfg.data.eval_samples > 0:  # held-out reward at the training temperature
            sampled = eval_tasks(self.eval_items, self.step, self.version, "s", self.cfg.data.eval_samples, {})
            sampled_ids = await self._publish(sampled)
        # Wait as a step does (_wait_generated resyncs a generator Ray restarted meanwhile, which serves
        # nothing until it has the current weights): collect_eval alone would wait its whole timeout, twice,
        # for groups a restarted lone generator never makes (the soak's async hangs, 2026-12-04).
        await self._wait_generated(greedy_ids + sampled_ids, timeout)
        greedy = await self.assembler.collect_eval(greedy_ids, timeout)
        result = {k: v for k, v in greedy.items() if k not in ("eval_reward_mean", "eval_sample_accuracy")}
        if sampled_ids:
            sampled = await self.assembler.collect_eval(sampled_ids, timeout)
            result["eval_reward_mean"] = sampled["eval_reward_mean"]
            result["eval_sample_accuracy"] = sampled["eval_sample_accuracy"]
        result["time_eval"] = time.perf_counter() - start
        self.report.phase(self.step, "evaluated", s=round(result["time_eval"], 3))
        return result

    async def queue_depths(self) -> dict[str, float]:
        depths = {stage: await s.depth() for stage, s in self.depth_streams.items()}
        return {f"queue_{stage}_{k}": float(d[k]) for stage, d in depths.items() for k in ("length", "pending")}

    # -- the step ----------------------------------------------------------------------------

    async def _top_up(self, step: int, task_ids: list[str], rounds: int = 2) -> tuple[list[str], float]:
        """Replaces filtered/dropped prompts with fresh ones until the step has prompts_per_step
        kept groups, for at most `rounds` rounds (dynamic sampling). Costs the scoring wait of each
        round, so it is off by default. Every replacement is a task of its own in the ledger."""
        want = self.cfg.coordinator.prompts_per_step
        ids = list(task_ids)
        added = 0
        for _ in range(rounds):
            outcomes = await self.assembler.peek(ids, self.version, self.cfg.coordinator.step_timeout_s)
            short = want - sum(o == "trained" for o in outcomes.values())
            if short <= 0:
                break
            new = await self._publish(self._tasks(step, self.cursor.take(short), self.version, first_slot=len(ids)))
            await self._wait_generated(new, self.cfg.coordinator.step_timeout_s)
            ids += new
            added += len(new)
        return ids, float(added)

    async def run_step(self, step: int, task_ids: list[str], next_publish=None) -> dict[str, float]:
        cfg = self.cfg
        colocated = cfg.coordinator.mode == "colocated"
        t0 = time.perf_counter()
        m: dict[str, float] = {}
        last_generated = await self._wait_generated(task_ids, cfg.coordinator.step_timeout_s)
        if cfg.assembler.replace_filtered:
            task_ids, m["prompts_replacement"] = await self._top_up(step, task_ids)
            last_generated = await self._wait_generated(task_ids, cfg.coordinator.step_timeout_s)
        gen_done = time.perf_counter()
        self.report.phase(step, "generated", missing=self.generated.missing(task_ids))
        m["time_generation"] = gen_done - t0
        if colocated:
            t = time.perf_counter()
            await self.generators.sleep(cfg.generator.sleep_level)
            m["time_generator_sleep"] = time.perf_counter() - t
            t = time.perf_counter()
            await self.learner.wake()
            m["time_learner_wake"] = time.perf_counter() - t
        if next_publish is not None:
            await next_publish()  # async mode: the next step generates while this one trains
        t = time.perf_counter()
        result = await self.assembler.collect(step, task_ids, self.version, cfg.coordinator.step_timeout_s)
        scored_done = time.perf_counter()
        # Scoring still running after the last group was generated (and after the sleep).
        m["time_exposed_scoring"] = max(0.0, scored_done - max(t, gen_done))
        m["exposed_scoring_after_last_generated"] = max(0.0, time.time() - last_generated) if last_generated else 0.0
        self.ledger.update(result["outcomes"])
        m.update(result["metrics"])
        trained = result["published"]
        self.report.phase(step, "collected", published=trained)
        if trained:
            t = time.perf_counter()
            train_metrics = await self.learner.train_from_stream(step)
            m["time_training"] = time.perf_counter() - t
            m.update({f"train_{k}" if not k.startswith("train_") else k: v for k, v in train_metrics.items()})
            self.report.phase(step, "trained", s=round(m["time_training"], 3))
        else:
            m["time_training"] = 0.0
            m["skipped_update"] = 1.0
        if colocated:
            t = time.perf_counter()
            await self.learner.sleep()
            m["time_learner_sleep"] = time.perf_counter() - t
            t = time.perf_counter()
            await self.generators.wake(["weights"])
            m["time_generator_wake_weights"] = time.perf_counter() - t
        else:
            t = time.perf_counter()
            # Partial rollouts: engines park their running requests and continue them after the
            # sync (resume below) instead of the boundary waiting for the longest one.
            parked = await self.generators.pause(cfg.generator.partial_rollouts)
            m["time_generator_pause"] = time.perf_counter() - t
            m["interrupted_requests"] = float(sum(p or 0 for p in parked))
            self.report.phase(step, "paused", parked=m["interrupted_requests"])
        if trained:
            m["time_weight_sync"] = await self.weights.sync(self.version + 1)
            m["weight_sync_bytes"] = self.weights.last_sync_bytes
            self.version += 1
            self.report.phase(step, "synced", version=self.version, s=round(m["time_weight_sync"], 3))
        elif colocated and cfg.generator.sleep_level == 2:
            # Level 2 dropped the engine's weights: give back the unchanged ones.
            m["time_weight_sync"] = await self.weights.sync(self.version)
            m["weight_sync_bytes"] = self.weights.last_sync_bytes
        await self.generators.set_version(self.version)
        if colocated:
            t = time.perf_counter()
            await self.generators.wake(["kv_cache"])
            m["time_generator_wake_kv"] = time.perf_counter() - t
        await self.generators.resume()  # sleep and pause both stop pulling
        self.report.phase(step, "resumed", version=self.version)
        m["time_step"] = time.perf_counter() - t0
        m["policy_version"] = float(self.version)
        tokens = m.get("train_num_tokens", 0.0)  # the learner's packed tokens of the step
        m["tokens_per_s"] = tokens / m["time_step"] if m["time_step"] > 0 else 0.0
        m["samples_per_s"] = m.get("train_samples", 0.0) / m["time_step"] if m["time_step"] > 0 else 0.0
        m.update(await self.queue_depths())
        return m

    def attach_metrics(self) -> None:
        """Inside the actor: the run's metrics.jsonl (and W&B when logging.wandb is on)."""
        self.report.attach()

    # -- what the launcher starts beside the loop: the initial sync, the resume; checkpoints ----

    async def initial_sync(self, warm_start_metrics: dict[str, float]) -> None:
        """Before the first step (actors/coordinator/sync.py WeightSync.initial)."""
        await self.weights.initial(self.version, warm_start_metrics)

    async def save_checkpoint(self, step: int, before_latest: Callable[[], None] | None = None) -> Path:
        """The learner's state and ours (actors/coordinator/checkpoint.py), with the cursor where step+1
        starts: its prompts may already be published (taken from the cursor); a resume takes them again.
        `before_latest` runs before the checkpoint becomes the one a resume starts from (the step's row)."""
        return await self.checkpoints.save(step, self.version, self._cursor_before.get(step + 1, self.cursor.state()),
                                           self.ledger, before_latest=before_latest, resyncs=self.weights.resyncs,
                                           frozen_restarts=self.generators.frozen_restarts)

    async def resume_from(self, path: Path) -> None:
        """Continues after the checkpoint at `path`: the next step, the same data order, its weights."""
        saved = await self.checkpoints.load(path, len(self.train_items))
        self.step, self.version, self.cursor, self.ledger = saved.step + 1, saved.version, saved.cursor, saved.ledger
        await self.weights.load(self.version)  # the generators start from the initial weights: the checkpoint's

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        await self.connect()
        beat = start_heartbeat(self)  # a frozen generator restarted within ~15 s (actors/coordinator/heartbeat.py)
        try:
            return await self._steps()
        finally:
            await stop_heartbeat(beat)
            await self.disconnect()

    async def _steps(self) -> dict[str, Any]:
        cfg = self.cfg.coordinator
        started = time.monotonic()
        per_step = self.cfg.coordinator.prompts_per_step
        pending: list[tuple[int, list[str]]] = []  # async mode: steps published ahead

        async def publish_step(step: int) -> None:
            self._cursor_before = {s: c for s, c in self._cursor_before.items() if s >= step - 1}
            self._cursor_before[step] = self.cursor.state()
            tasks = self._tasks(step, self.cursor.take(per_step), self.version)
            pending.append((step, await self._publish(tasks)))

        first = self.step
        if self.step == 0 and cfg.eval_every:
            self.report.eval(self.step, await self._eval())
        if self.step < cfg.steps:
            await publish_step(self.step)
        while self.step < cfg.steps and not self._stop:
            step, task_ids = pending.pop(0)
            ahead = None
            if cfg.mode == "async" and step + 1 < cfg.steps and len(pending) < self.cfg.assembler.max_staleness:
                async def ahead(s=step):
                    # Up to max_staleness steps published ahead (each is trained at most that many
                    # versions after it was published), so the engines never run out of work.
                    nxt = s + 1 + len(pending)
                    while len(pending) < self.cfg.assembler.max_staleness and nxt < cfg.steps:
                        await publish_step(nxt)
                        nxt += 1
            m = await self.run_step(step, task_ids, next_publish=ahead)
            if cfg.mode == "colocated" or not pending:
                if step + 1 < cfg.steps:
                    await publish_step(step + 1)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                m.update(await self._eval())
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                t = time.perf_counter()
                if step + 1 >= cfg.steps:
                    await self._rest_generators()

                def row() -> None:  # called within save_checkpoint, before it can be resumed from: never lost
                    m["time_checkpoint"] = time.perf_counter() - t
                    self.report.step(step, m)

                await self.save_checkpoint(step, before_latest=row)
            else:
                self.report.step(step, m)
            self.step = step + 1
            await self.assembler.forget_before(step - 2)
            self.generated.forget(step - 2)
            if cfg.time_budget_s and time.monotonic() - started > cfg.time_budget_s:
                break
        if self.step > first and not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
            self.report.phase(self.step - 1, "final checkpoint")
            await self._rest_generators()
            await self.save_checkpoint(self.step - 1)
        self.report.phase(self.step - 1, "loop done")
        self.report.close()
        return {"steps": self.step, "version": self.version, "outcomes": count_outcomes(self.ledger.values()),
                "ledger_size": len(self.ledger)}

    async def _rest_generators(self) -> None:
        """Colocated, before the final checkpoint: the engines have no more work, so they sleep and the
        learner's save (which brings its offloaded optimizer state back to the device) never shares the
        device with a resident engine. Once: the run ends after it."""
        if self.cfg.coordinator.mode == "colocated" and not self._generators_resting:
            self._generators_resting = True
            await self.generators.sleep(self.cfg.generator.sleep_level)

    def __repr__(self) -> str:  # the Ray dashboard's Repr column: live state
        cfg = getattr(self, "cfg", None)  # also called by Ray before __init__ finished
        steps = cfg.coordinator.steps if cfg is not None else "?"
        return (f"Coordinator({getattr(self, 'run_id', '?')}: step {getattr(self, 'step', 0)}/{steps}, "
                f"version {getattr(self, 'version', 0)}, {len(getattr(self, 'ledger', {}))} prompts accounted)")

    def stop(self) -> None:
        self._stop = True

    def pid(self) -> int:
        return os.getpid()

    def get_ledger(self) -> dict[str, str]:
        return dict(self.ledger)

