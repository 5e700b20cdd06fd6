"""The scorer: RolloutGroup in, ScoredGroup out, SQL executed in a sandboxed process pool.

Invariants:
- Every sample of every consumed group gets one verdict and its reward (policies.sql_reward);
  a group the generator failed gets "generation_error" for every sample, and a group whose gold
  SQL fails gets "gold_failed" for every sample and gold_failed=True (excluded from training,
  counted), never a silent 0.
- A rollouts message is acked only after its ScoredGroup is published, so a scorer that dies
  mid-group leaves the message pending for a live scorer to reclaim; nothing is lost. A message
  that cannot be decoded is acked and counted (retrying it could never succeed).
- Gold results are cached per (database, gold SQL); identical predictions in a group run once.
- The scorer never sees the model: it scores the text the generator put in each Sample, or, for a
  multi-turn episode, its final `answer` as is (an empty answer is "no_sql"); an episode group also
  gets `first_query_rewards` (its first query scored as if it were the answer).
- With a `db_root` (the run's BIRD or synthetic data directory; the actor takes its RunContext's
  `data_dir`, which the launcher sets), a task whose `db_path` does not resolve to a file under it is never opened: every
  sample gets "bad_db_path" and the group is excluded like a failed gold (a writer to a shared Redis
  cannot make the scorer open an arbitrary SQLite file).
"""
from __future__ import annotations

import asyncio
import collections
import os
import socket
import time

import msgspec
import structlog

from actors.shell import RESTARTABLE, built_with_gc_paused
from config import RunContext, ScorerConfig
from observe.logs import setup_actor_logging
from policies.sql_reward import BAD_DB_PATH, GENERATION_ERROR, extract_sql, reward_for, shaped_reward
from queues.messages import RolloutGroup, SchemaError, ScoredGroup, codec
from tasks.sandbox import GoldCache, score_group
from tasks.sql_pool import SqlPool

log = structlog.get_logger("arctic_rl.scorer")


class Scorer:
    """Plain (Ray-free) scorer: owns a SqlPool and a GoldCache."""

    def __init__(self, cfg: ScorerConfig | None = None, scorer_id: str = "", db_root: str = ""):
        self.cfg = cfg or ScorerConfig()
        # Lexical containment (abspath + normpath: "..", absolute paths): a BIRD directory whose
        # databases are symlinks to another disk still works.
        self.db_root = os.path.normpath(os.path.abspath(db_root)) if db_root else ""
        self.scorer_id = scorer_id or f"scorer-{socket.gethostname()}-{os.getpid()}"
        self.pool = SqlPool(workers=self.cfg.workers, timeout_s=self.cfg.timeout_s, max_rows=self.cfg.max_rows,
                            memory_mb=self.cfg.memory_mb, temp_store_mb=self.cfg.temp_store_mb)
        self.gold_cache = GoldCache(self.cfg.gold_cache_size)
        self.verdicts: collections.Counter[str] = collections.Counter()
        self.groups = 0
        self.gold_failed_groups = 0
        self.pred_queries = 0
        self.samples = 0
        self.score_seconds = 0.0

    async def score(self, group: RolloutGroup) -> ScoredGroup:
        start = time.monotonic()
        n = len(group.samples)
        gold_failed = False
        first_rewards: list[float] = []
        if group.error:
            verdicts = [GENERATION_ERROR] * n
            rewards = [reward_for(GENERATION_ERROR)] * n
        elif not self._allowed(group.task.db_path):
            log.warning("scorer.bad_db_path", prompt_id=group.task.prompt_id, db_path=group.task.db_path[:300],
                        db_root=self.db_root)
            verdicts = [BAD_DB_PATH] * n
            rewards = [reward_for(BAD_DB_PATH)] * n
            gold_failed = True  # excluded from training, counted as the step's gold_failed outcome
        else:
            texts = [s.text for s in group.samples]
            episodes = any(s.turns > 1 or s.queries for s in group.samples)
            answers = [s.answer if episodes else None for s in group.samples]  # an episode's final SQL as is
            result = await score_group(self.pool, group.task.db_path, group.task.gold_sql, texts, self.gold_cache,
                                       answers=answers)
            verdicts, rewards, gold_failed = result.verdicts, result.rewards, result.gold_failed
            weights = (self.cfg.reward_syntax, self.cfg.reward_schema_linking, self.cfg.reward_format)
            if any(weights) and not gold_failed:  # the partial terms (all 0: the rewards above exactly)
                preds = [a if a is not None else extract_sql(t) for a, t in zip(answers, texts)]
                rewards = [shaped_reward(v, t, p, group.task.gold_sql, *weights)
                           for v, t, p in zip(verdicts, texts, preds)]
            self.pred_queries += result.executed
            if episodes and not gold_failed:  # what the first query would have earned (revision_gain)
                firsts = [s.queries[0] if s.queries else s.answer for s in group.samples]
                first = await score_group(self.pool, group.task.db_path, group.task.gold_sql, texts, self.gold_cache,
                                          answers=firsts)
                first_rewards = first.rewards
                self.pred_queries += first.executed
            if gold_failed:
                log.warning("scorer.gold_failed", prompt_id=group.task.prompt_id, db_path=group.task.db_path,
                            error=str(result.gold_error)[:300])
        seconds = time.monotonic() - start
        self.groups += 1
        self.samples += n
        self.gold_failed_groups += int(gold_failed)
        self.verdicts.update(verdicts)
        self.score_seconds += seconds
        return ScoredGroup(rollout=group, rewards=rewards, verdicts=verdicts, gold_failed=gold_failed,
                           scorer_id=self.scorer_id, score_seconds=seconds, scored_at=time.time(),
                           first_query_rewards=first_rewards)

    def _allowed(self, db_path: str) -> bool:
        if not self.db_root:
            return True
        path = os.path.normpath(os.path.abspath(db_path or "."))
        return path.startswith(self.db_root + os.sep) and os.path.isfile(path)

    def stats(self) -> dict[str, float]:
        """All scalars: counts, verdict fractions, cache and pool health."""
        out: dict[str, float] = {
            "groups": float(self.groups), "samples": float(self.samples),
            "gold_failed_groups": float(self.gold_failed_groups), "pred_queries": float(self.pred_queries),
            "gold_cache_hits": float(self.gold_cache.hits), "gold_cache_misses": float(self.gold_cache.misses),
            "workers_replaced": float(self.pool.replaced), "score_seconds": self.score_seconds,
        }
        for v, c in self.verdicts.items():
            out[f"verdict/{v}"] = float(c)
        return out

    def close(self) -> None:
        self.pool.close()


class ScorerLoop:
    """The stream side: ROLLOUTS (its group, the scorers) -> score -> SCORED (queues.topology), on the one consumer loop
    (queues.worker.Worker: pending first, reclaim, heartbeat, ack after publish)."""

    def __init__(self, scorer: Scorer, consumer: str, reclaim_idle_s: float = 30.0, batch: int = 8):
        self.scorer = scorer
        self.consumer = consumer
        self.reclaim_idle_s = reclaim_idle_s
        self.batch = batch
        self.undecodable = 0
        self.worker = None
        self._stopped = False

    @property
    def inflight(self) -> dict:
        return self.worker.inflight if self.worker is not None else {}

    def stop(self) -> None:
        self._stopped = True
        if self.worker is not None:
            self.worker.stop()

    async def run(self, redis_url: str, run_id: str, high_water: int = 4096) -> None:
        from queues.streams import RunStreams
        from queues.topology import ROLLOUTS, SCORED
        from queues.worker import Worker

        conn = await RunStreams.open(redis_url, run_id)
        rollouts = conn.stream(ROLLOUTS, high_water=high_water)
        scored = conn.stream(SCORED, high_water=high_water)
        decode = codec(RolloutGroup).decode
        encode = codec(ScoredGroup).encode

        async def handle(entry_id: str, data: bytes) -> None:
            try:
                group = decode(data)
            except (SchemaError, msgspec.DecodeError) as e:
                self.undecodable += 1  # acked by the worker: retrying it could never succeed
                log.error("scorer.undecodable_dropped", entry_id=entry_id, error=str(e)[:300])
                return
            result = await self.scorer.score(group)
            await scored.publish(encode(result))  # the worker acks only after this

        # Up to `batch` groups in flight, refilled as each one finishes: one slow query holds one
        # slot, never the others (no head-of-line blocking behind a batch's slowest group).
        # A handler's failure ends the loop (Ray restarts the actor); its entry stays pending.
        self.worker = Worker(rollouts, self.consumer, handle, concurrency=self.batch,
                             reclaim_idle_s=self.reclaim_idle_s, on_error="raise")
        if self._stopped:
            self.worker.stop()
        try:
            await self.worker.run()
        finally:
            await conn.close()


class ScorerShell:
    """The scorer actor (actors.shell.ray_actor): Scorer + ScorerLoop; `ScorerActor` is its Ray class."""

    RAY_OPTIONS = dict(RESTARTABLE)  # a restarted scorer reclaims what it held (same consumer name)

    @built_with_gc_paused
    def __init__(self, cfg: ScorerConfig, ctx: RunContext | None = None, *, scorer_id: str = ""):
        self.ctx = ctx or RunContext()
        setup_actor_logging(scorer_id or "scorer", self.ctx)
        self.scorer = Scorer(cfg, scorer_id, db_root=self.ctx.data_dir)
        self.loop = ScorerLoop(self.scorer, consumer=self.scorer.scorer_id, reclaim_idle_s=self.ctx.reclaim_idle_s)
        log.info("scorer.started", scorer_id=self.scorer.scorer_id, workers=cfg.workers,
                 timeout_s=cfg.timeout_s, pid=os.getpid())

    def __repr__(self) -> str:  # the Ray dashboard's Repr column: live state
        s, loop = getattr(self, "scorer", None), getattr(self, "loop", None)  # Ray may ask before __init__ ends
        if s is None or loop is None:
            return "ScorerShell(starting)"
        return (f"ScorerShell({s.scorer_id}: {s.groups} groups, {s.samples} samples scored, "
                f"{len(loop.inflight)} in flight)")

    async def run(self) -> None:
        """The consumer loop until stop(), over the run's streams (ctx)."""
        from observe.ray_metrics import export_periodically

        exporter = asyncio.create_task(export_periodically(self.scorer.scorer_id or "scorer", self.scorer.stats))
        try:
            await self.loop.run(self.ctx.redis_url, self.ctx.run_id, self.ctx.stream_high_water)
        finally:
            exporter.cancel()

    async def stop(self) -> None:
        self.loop.stop()

    async def pid(self) -> int:
        return os.getpid()

    async def stats(self) -> dict[str, float]:
        return dict(self.scorer.stats(), undecodable=float(self.loop.undecodable))

    async def close(self) -> None:
        self.loop.stop()
        self.scorer.close()


def __getattr__(name: str):
    if name == "ScorerActor":  # Ray's actor class, made on first use (importing this module imports no Ray)
        from actors.shell import ray_actor

        return ray_actor(ScorerShell)
    raise AttributeError(name)
