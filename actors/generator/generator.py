"""Generator: pulls PromptTasks, runs each as its own engine request, streams each group out.

Invariants:
- Per-prompt fan-out: every task becomes one `engine.generate(task)`; its RolloutGroup is
  published to ROLLOUTS (queues.topology) the moment it finishes, whatever the others are doing.
  Up to `max_inflight_prompts` requests are in flight at once.
- A task is acked on PROMPTS only after its group is published, so a generator that dies
  mid-task leaves it pending; live generators reclaim (XAUTOCLAIM) tasks idle longer than
  `reclaim_idle_s`. A live generator keeps its own in-flight tasks fresh (heartbeat) so
  they are not stolen while it still works on them. All three are the one consumer loop's
  (queues/worker.py).
- Every task yields exactly one group: a task that cannot be generated (undecodable bytes,
  empty or over-length prompt, n < 1, bad sampling override, decode failure) gets a group
  with a one-line `error` and no samples, and the generator keeps serving.
- Every group carries the policy version of the weights that produced it (the engine's
  version when its request started) and the generator's id and timestamps.
- `pause()` stops pulling and returns only when every in-flight group is published; `sleep`
  pauses first, then releases engine memory; `wake`/`load_weights`/`finish_weight_update`
  return when the engine is done. `resume()` starts pulling again.
- `pause(interrupt=True)` (async mode with partial rollouts, on an engine that supports them)
  returns as soon as the engine has parked its running requests: they stay in flight, keep their
  tokens, and `resume()` continues them under the weights loaded meanwhile, so a weight update
  never waits for the longest response. A waiting `pause()` or `sleep` continues parked requests
  first (they must finish before it returns).

`GeneratorActor` (actors/generator/shell.py) is the thin Ray shell.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable

import structlog

from actors.engines.base import Engine, EngineAsleep, TaskError
from config import GeneratorConfig
from queues.errors import one_line
from queues.messages import Event, PromptTask, RolloutGroup, codec

log = structlog.get_logger("arctic_rl.generator")  # %-style calls format as in logging


ABORT_GRACE_S = 30.0  # after a pause timed out and aborted its requests, how long their groups may take
# How long one read of the prompts stream blocks when nothing is there. A pause waits for the read under way
# to return (what it takes must be handled before the engine sleeps), so this bounds every colocated step's
# sleep handshake: at 200 ms it cost tiny a median 0.16 s a step (~13 % of its 1.2 s step on 2 cores). An idle
# generator reads 50 times a second; a busy or paused one does not read at all.
CONSUME_BLOCK_MS = 20


class Generator:
    def __init__(self, engine: Engine, generator_cfg: GeneratorConfig, *, reclaim_idle_s: float = 30.0,
                 stream_high_water: int = 4096, consume_block_ms: int = CONSUME_BLOCK_MS, tokenizer: Any = None):
        self.engine = engine
        self.cfg = generator_cfg
        self._tokenizer = tokenizer  # multi-turn episodes: the observations' tokenizer (default: the engine's)
        self.episodes = None  # actors/generator/episode.py EpisodeRunner, built on first use (max_turns > 1)
        self.max_inflight = max(1, int(generator_cfg.max_inflight_prompts))
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.stream_high_water = stream_high_water
        self.consume_block_ms = consume_block_ms
        self.generator_id = ""
        self._worker = None  # queues.worker.Worker over the prompts stream, while run() runs
        self._paused = False
        self._stop = False
        self._events = None
        self._loop_bound: asyncio.AbstractEventLoop | None = None
        self._interrupted = False  # the engine holds requests parked by pause(interrupt=True)
        self._m = {"pause_timeouts": 0, "interrupts": 0, "interrupted_requests": 0, "partial_samples": 0, "groups_published": 0, "error_groups": 0, "tasks_reclaimed": 0, "tokens": 0,
                   "queue_wait_s": 0.0, "publish_latency_s": 0.0, "gen_s": 0.0}
        self._first_start: float | None = None
        self._last_finish: float | None = None

    # -- event-loop plumbing -----------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_bound is not loop:
            self._loop_bound = loop
            self._resumed = asyncio.Event()
            self._changed = asyncio.Event()  # set whenever in-flight count or pulling changes
            if not self._paused:
                self._resumed.set()

    def _notify(self) -> None:
        self._changed.set()

    async def _wait_until(self, cond, timeout_s: float | None = None) -> bool:
        """Waits for `cond`; False if `timeout_s` passed first (None: no bound)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not cond():
            self._changed.clear()
            if cond():
                return True
            if deadline is None:
                await self._changed.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return cond()
        return True

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, redis_url: str, run_id: str, generator_id: str) -> None:
        """Serves tasks until stop(); raises RedisUnavailable if Redis goes away for good.

        The prompts stream is read by the one consumer loop (queues.worker.Worker): this consumer's
        own pending tasks first, reclaim of a dead peer's, a heartbeat over the tasks in flight here,
        ack after the group (and its "generated" event) is published; no intake while paused."""
        from queues.streams import RunStreams
        from queues.topology import EVENTS, PROMPTS, ROLLOUTS
        from queues.worker import Worker

        self._bind()
        self.generator_id = generator_id
        self._stop = False
        conn = await RunStreams.open(redis_url, run_id)
        prompts = conn.stream(PROMPTS)
        rollouts = conn.stream(ROLLOUTS, high_water=self.stream_high_water)
        # "generated" notices let the coordinator sleep the engines the moment a step is done.
        self._events = conn.stream(EVENTS, high_water=0)
        # A failed publish (Redis gone past its retry budget) is logged and leaves the task pending for
        # a reclaim; stop() waits for what is in flight (drain_s=None: the engine bounds a request).
        self._worker = Worker(prompts, generator_id, lambda eid, data: self._serve(data, rollouts),
                              concurrency=self.max_inflight, reclaim_idle_s=self.reclaim_idle_ms / 1000,
                              block_ms=self.consume_block_ms, on_error="leave", drain_s=None, read_count=32,
                              may_pull=lambda: not self._paused, on_change=self._notify)
        try:
            await self._worker.run()
        finally:
            self._m["tasks_reclaimed"] += self._worker.reclaimed
            self._worker = None
            await conn.close()

    @property
    def _inflight(self) -> dict[str, asyncio.Task]:
        """prompts-stream entry id -> serving task (the consumer loop's)."""
        return self._worker.inflight if self._worker is not None else {}

    @property
    def _pulling(self) -> bool:
        return self._worker is not None and self._worker.pulling

    async def _serve(self, data: bytes, rollouts) -> None:
        group = await self.generate_one(data)
        group.published_at = time.time()
        await rollouts.publish(codec(RolloutGroup).encode(group))
        # The event goes out before the ack: a crash between the two redoes the task (a
        # duplicate the assembler ignores) instead of losing the event the coordinator awaits.
        if self._events is not None:
            await self._events.publish(codec(Event).encode(Event(
                kind="generated", source=self.generator_id, step=group.task.step, task_id=group.task.task_id,
                prompt_id=group.task.prompt_id, at=group.published_at)), wait=False)
        self._count(group)

    async def generate_one(self, data: bytes | PromptTask) -> RolloutGroup:
        """One task (bytes off the stream, or a PromptTask) -> its group; never raises for a bad task."""
        queued_at = time.time()
        if isinstance(data, PromptTask):
            task = data
        else:
            try:
                task = codec(PromptTask).decode(data)
            except Exception as e:
                task = PromptTask(task_id="", prompt_id="", step=-1, policy_version=-1, prompt_tokens=b"", n=0)
                return self._error_group(task, f"cannot decode PromptTask: {one_line(e)}", queued_at)
        if self._first_start is None:
            self._first_start = queued_at
        try:
            if self.cfg.max_turns > 1:
                group = await self._episode_runner().generate(task)
            else:
                group = await self.engine.generate(task)
        except (TaskError, EngineAsleep) as e:
            return self._error_group(task, str(e).splitlines()[0], queued_at)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return self._error_group(task, f"task {task.task_id}: generation failed: {one_line(e)}", queued_at)
        group.generator_id = self.generator_id
        group.queued_at = queued_at
        if any(s.finish_reason == "abort" for s in group.samples):
            # One aborted sample is cut short by the abort, not by the model: its reward and the
            # group's baseline would be wrong, so the whole group fails (its prompt is accounted for).
            group.error = f"task {task.task_id}: aborted"
        self._last_finish = time.time()
        return group

    def _episode_runner(self):
        if self.episodes is None:
            from actors.generator.episode import EpisodeRunner
            from config import ScorerConfig
            from tasks.executor import ToolExecutor

            c, scorer = self.cfg, ScorerConfig()  # 0 (a config built without validation): the scorer's defaults
            executor = ToolExecutor(workers=c.tool_workers, timeout_s=c.tool_timeout_s or scorer.timeout_s,
                                    max_rows=c.tool_max_rows or scorer.max_rows)
            self.episodes = EpisodeRunner(self.engine, c, self._tokenizer or self.engine.tokenizer, executor)
        return self.episodes

    def close_episodes(self) -> None:
        """Stops the episode executor's query processes (a no-op without episodes)."""
        if self.episodes is not None:
            self.episodes.executor.close()

    def _error_group(self, task: PromptTask, error: str, queued_at: float) -> RolloutGroup:
        now = time.time()
        return RolloutGroup(task=task, samples=[], policy_version=self.engine.version, generator_id=self.generator_id,
                            error=error, queued_at=queued_at, started_at=now, finished_at=now)

    def _count(self, group: RolloutGroup) -> None:
        m = self._m
        m["groups_published"] += 1
        if group.error:
            m["error_groups"] += 1
            return
        m["tokens"] += sum(len(s.tokens) // 4 for s in group.samples)
        m["partial_samples"] += sum(1 for s in group.samples if s.versions)
        if group.task.published_at:
            m["queue_wait_s"] += max(0.0, group.queued_at - group.task.published_at)
        m["publish_latency_s"] += max(0.0, group.published_at - group.finished_at)
        m["gen_s"] += max(0.0, group.finished_at - group.started_at)

    # -- control -----------------------------------------------------------------------------

    async def pause(self, interrupt: bool = False) -> int:
        """Stops pulling; returns once every in-flight group is published, or with interrupt=True
        (and an engine that supports it) once the engine has parked them (module invariant).
        Returns how many requests the engine parked (0 for a waiting pause)."""
        self._bind()
        self._paused = True
        self._resumed.clear()
        self._notify()
        if interrupt and self.engine.supports_partial:
            t0 = time.perf_counter()
            # The read under way returns within the worker's read bound; the pause's own bound covers a stuck one.
            if not await self._wait_until(lambda: not self._pulling, float(self.cfg.pause_timeout_s) or None):
                raise TimeoutError(f"generator {self.generator_id}: its read of the prompts stream did not end within "
                                   f"generator.pause_timeout_s={self.cfg.pause_timeout_s:g} s of the pause")
            parked = await self.engine.interrupt()
            self._m["interrupts"] += 1
            self._m["interrupted_requests"] += parked
            self._interrupted = True
            log.info("generator.interrupted", generator_id=self.generator_id, parked=parked,
                     inflight=len(self._inflight), s=round(time.perf_counter() - t0, 3))
            return parked
        self._continue_parked()
        drained = lambda: not self._pulling and not self._inflight  # noqa: E731
        timeout = float(self.cfg.pause_timeout_s) or None
        if not await self._wait_until(drained, timeout):
            # A hung request must not hang the run: abort what is in flight; each group comes back
            # aborted and is published as a failed group (error set), so its prompt is accounted for.
            stuck = len(self._inflight)
            log.warning("generator %s: pause waited %.0f s for %d request(s); aborting them", self.generator_id,
                        timeout, stuck)
            self._m["pause_timeouts"] += 1
            self.engine.abort()
            if not await self._wait_until(drained, ABORT_GRACE_S):
                raise TimeoutError(f"generator {self.generator_id}: {len(self._inflight)} request(s) still in flight "
                                   f"{timeout + ABORT_GRACE_S:.0f} s after pause (generator.pause_timeout_s="
                                   f"{timeout:g}); the engine did not abort them")
        return 0

    def _continue_parked(self) -> None:
        if self._interrupted:
            self._interrupted = False
            continued = self.engine.continue_interrupted()
            log.info("generator.continued", generator_id=self.generator_id, parked=continued, version=self.engine.version)

    def resume(self) -> None:
        self._bind()
        self._continue_parked()
        self._paused = False
        self._resumed.set()
        self._notify()
        if self._worker is not None:
            self._worker.wake()

    def stop(self) -> None:
        """run() returns after its in-flight tasks are published (parked ones continue first)."""
        self._bind()
        self._continue_parked()
        self._stop = True
        self._resumed.set()
        self._notify()
        if self._worker is not None:
            self._worker.stop()

    def abort(self) -> None:
        self.engine.abort()

    async def sleep(self, level: int) -> None:
        await self.pause()
        await self.engine.sleep(level)

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.engine.wake(tags)

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        await self.engine.load_weights(named_tensors, version)

    async def finish_weight_update(self, version: int) -> None:
        t0 = time.perf_counter()
        await self.engine.finish_weight_update(version)
        log.info("generator.weights_updated", generator_id=self.generator_id, version=int(version),
                 s=round(time.perf_counter() - t0, 3), inflight=len(self._inflight))

    def set_version(self, version: int) -> None:
        """For syncs that bypass load_weights: from now on groups carry `version`."""
        self.engine.version = int(version)

    @property
    def version(self) -> int:
        return self.engine.version

    def stats(self) -> dict[str, float]:
        m = self._m
        ok = max(1, m["groups_published"] - m["error_groups"])
        span = (self._last_finish - self._first_start) if (self._first_start and self._last_finish) else 0.0
        out = {
            "generator_groups_published": float(m["groups_published"]),
            "generator_error_groups": float(m["error_groups"]),
            "generator_tasks_reclaimed": float(m["tasks_reclaimed"] + (self._worker.reclaimed if self._worker else 0)),
            "generator_inflight_prompts": float(len(self._inflight)),
            "generator_paused": float(self._paused),
            "generator_tokens": float(m["tokens"]),
            "generator_interrupts": float(m["interrupts"]),
            "generator_pause_timeouts": float(m["pause_timeouts"]),
            "generator_interrupted_requests": float(m["interrupted_requests"]),
            "generator_partial_samples": float(m["partial_samples"]),
            "generator_tokens_per_s": m["tokens"] / span if span > 0 else 0.0,
            "generator_mean_queue_wait_s": m["queue_wait_s"] / ok,
            "generator_mean_publish_latency_s": m["publish_latency_s"] / ok,
            "generator_mean_generate_s": m["gen_s"] / ok,
            "policy_version": float(self.engine.version),
        }
        out.update(self.engine.stats())
        if self.episodes is not None:
            out.update({f"generator_{k}": v for k, v in self.episodes.executor.stats().items()})
        return out
