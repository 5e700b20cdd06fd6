"""Assembler: scored groups in, one packed TrainBatch per step out.

Invariants:
- Every task the coordinator asks about ends with exactly one outcome: "trained", or dropped as
  "filtered" (zero-variance rewards), "stale" (its OLDEST token more than max_staleness versions
  behind: a partial rollout is as old as its first token), "gold_failed"
  or "failed" (generation error). A redelivered ScoredGroup (same task) is acked and ignored:
  it is never trained twice.
- A step's ScoredGroups are acked only after its TrainBatch is on the batches stream. If this
  actor dies first, the groups stay pending, a restarted assembler (same consumer name) reads
  them back, and the batch is rebuilt identically; the learner ignores a second batch for a step
  it already trained. The scored stream is read by the one consumer loop (queues.worker.Worker with
  acks="handler": this consumer's pending groups first, reclaim on the one cadence, never an ack
  before the batch); an undecodable message is acked and counted, and its task ends "failed".
- Packing follows policies.packing (policies.prefix with share_prompt: groups as units, the prompt
  counted once): every kept sample lands in exactly one micro-batch. A sample's tokens are its whole
  episode (observations included: they sit in the learner's row); its Sample.loss_mask travels in
  TrainGroup.loss_masks (none when no sample of the group has one).
- Overlong handling (policies/overlong.py, assembler.overlong) happens before admission: a soft penalty
  changes the rewards that admission and advantages see; "filter" cuts truncated samples from the batch
  after their group's advantages are computed, and a group whose samples are all truncated is "filtered".
  "none" leaves every reward and sample as scored. Its counts are in the step's metrics.
- Staleness metrics are over the tokens of the trained groups, in versions behind the step's
  version: mean, max, the fraction of tokens at each lag (`tokens_lag<k>_frac`, summing to 1) and
  the fraction of samples whose tokens span more than one version (partial rollouts).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import msgspec
import numpy as np
import structlog

from actors.shell import RESTARTABLE, built_with_gc_paused
from config import AssemblerConfig, RunContext
from observe.logs import setup_actor_logging
from policies.advantages import group_advantages
from policies.episode import episode_metrics
from policies.overlong import shape
from policies.plan import plan_group_micro_batches, plan_micro_batches, split_minibatches
from queues.errors import one_line
from queues.messages import (  # noqa: F401
    SchemaError,
    ScoredGroup,
    TrainBatch,
    TrainGroup,
    codec,
    oldest_version,
    sample_versions,
    task_step,  # task_step: re-exported (it lives in queues.messages)
)

log = structlog.get_logger("arctic_rl.assembler")

TRAINED, FILTERED, STALE, GOLD_FAILED, FAILED = "trained", "filtered", "stale", "gold_failed", "failed"
OUTCOMES = (TRAINED, FILTERED, STALE, GOLD_FAILED, FAILED)


def admit(group: ScoredGroup, version: int, cfg: AssemblerConfig) -> str:
    """The outcome of one scored group against the current policy version (pure)."""
    if group.rollout.error or not group.rollout.samples:
        return FAILED
    if group.gold_failed:
        return GOLD_FAILED
    if version - oldest_version(group.rollout) > cfg.max_staleness:
        return STALE
    if cfg.filter_zero_variance and len(set(group.rewards)) <= 1:
        return FILTERED
    if cfg.overlong == "filter" and all(s.finish_reason == "length" for s in group.rollout.samples):
        return FILTERED
    return TRAINED


def apply_overlong(group: ScoredGroup, cfg: AssemblerConfig) -> tuple[ScoredGroup, list[bool], dict[str, float]]:
    """(the group with shaped rewards, keep per sample, counts) under cfg.overlong (pure)."""
    samples = group.rollout.samples
    if cfg.overlong == "none" or group.rollout.error or not samples:
        return group, [True] * len(samples), {}
    rewards, keep, counts = shape(group.rewards, [len(s.tokens) // 4 for s in samples],
                                  [s.finish_reason == "length" for s in samples], cfg.overlong,
                                  cfg.max_tokens, cfg.overlong_buffer)
    return msgspec.structs.replace(group, rewards=rewards), keep, counts


def build_batch(step: int, version: int, groups: list[ScoredGroup], cfg: AssemblerConfig,
                keep: list[list[bool]] | None = None) -> TrainBatch:
    """Advantages per group, then a token-budget packing plan over all kept samples (pure).

    `keep[g][i]` False cuts sample i of group g after the advantages (overlong "filter"); None keeps all.

    With cfg.share_prompt (set from learner.share_prompt) groups are planned as units with the
    prompt counted once (policies/prefix.py); num_tokens and the minibatch balance use those counts.
    """
    train_groups: list[TrainGroup] = []
    flat: list[tuple[int, int]] = []
    lengths: list[int] = []
    prompt_lens: list[int] = []
    comp_lens: list[list[int]] = []
    for gi, g in enumerate(groups):
        adv, _ = group_advantages([g.rewards], normalize_std=cfg.normalize_std)
        kept = [i for i in range(len(g.rollout.samples)) if keep is None or keep[gi][i]]
        samples = [g.rollout.samples[i] for i in kept]
        prompt = g.rollout.task.prompt_tokens
        train_groups.append(TrainGroup(
            prompt_id=g.rollout.task.prompt_id, prompt_tokens=prompt,
            completions=[s.tokens for s in samples], gen_logprobs=[s.logprobs for s in samples],
            advantages=[float(adv[0][i]) for i in kept], rewards=[g.rewards[i] for i in kept],
            policy_version=oldest_version(g.rollout),
            loss_masks=[s.loss_mask for s in samples] if any(s.loss_mask for s in samples) else []))
        prompt_len = len(prompt) // 4
        prompt_lens.append(prompt_len)
        comp_lens.append([len(s.tokens) // 4 for s in samples])
        for si, s in enumerate(samples):
            flat.append((gi, si))
            lengths.append(prompt_len + len(s.tokens) // 4)
    if cfg.share_prompt:
        pairs, tokens = plan_group_micro_batches(prompt_lens, comp_lens, cfg.micro_batch_tokens) if flat else ([], [])
        minibatches = split_minibatches(pairs, cfg.minibatches_per_step, tokens=tokens) if pairs else []
        return TrainBatch(step=step, policy_version=version, groups=train_groups, micro_batches=pairs,
                          minibatches=minibatches, num_tokens=sum(tokens))
    micro = plan_micro_batches(lengths, cfg.micro_batch_tokens) if flat else []
    minibatches = split_minibatches(micro, cfg.minibatches_per_step, lengths) if micro else []
    return TrainBatch(step=step, policy_version=version, groups=train_groups,
                      micro_batches=[[flat[i] for i in mb] for mb in micro], minibatches=minibatches,
                      num_tokens=sum(lengths))


def staleness_metrics(groups: list[ScoredGroup], version: int) -> dict[str, float]:
    """Token staleness of the trained groups against `version` (see the module invariant; pure)."""
    lags: dict[int, int] = {}
    partial = samples = 0
    for g in groups:
        for s in g.rollout.samples:
            v = sample_versions(s, g.rollout.policy_version)
            samples += 1
            if len(v):
                partial += int(v.min() != v.max())
                for lag, count in zip(*np.unique(version - v, return_counts=True)):
                    lags[int(lag)] = lags.get(int(lag), 0) + int(count)
    tokens = sum(lags.values())
    m = {"staleness_mean": sum(k * c for k, c in lags.items()) / tokens if tokens else 0.0,
         "staleness_max": float(max(lags, default=0)),
         "partial_samples_frac": partial / samples if samples else 0.0}
    m.update({f"tokens_lag{k}_frac": c / tokens for k, c in sorted(lags.items())})
    return m


def step_metrics(groups: list[ScoredGroup], outcomes: dict[str, str]) -> dict[str, float]:
    """Scalars over every scored sample of the step (before filtering), plus outcome counts.
    response_len_* count every id after the prompt, a multi-turn episode's observation ids included
    (obs_tokens_mean says how many of them the observations are)."""
    rewards = [r for g in groups for r in g.rewards]
    verdicts = [v for g in groups for v in g.verdicts]
    lengths = [len(s.tokens) // 4 for g in groups for s in g.rollout.samples]
    truncated = [s.finish_reason == "length" for g in groups for s in g.rollout.samples]
    m: dict[str, float] = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "accuracy": sum(v == "match" for v in verdicts) / len(verdicts) if verdicts else 0.0,
        "response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "response_len_max": float(max(lengths, default=0)),
        "truncated_frac": sum(truncated) / len(truncated) if truncated else 0.0,
        "prompts": float(len(outcomes)),
    }
    m.update(episode_metrics(groups))  # turns_mean, tool_use_frac, revision_gain, ... (0 / 1 for one-shot steps)
    for outcome in OUTCOMES:
        m[f"prompts_{outcome}"] = float(sum(o == outcome for o in outcomes.values()))
    for verdict in set(verdicts):
        m[f"verdict_{verdict}"] = sum(v == verdict for v in verdicts) / len(verdicts)
    return m


class Assembler:
    """Consumes the scored stream; `collect` turns one step's groups into a TrainBatch."""

    # The coordinator's collect/outcome calls beside the consume loop; restarted by Ray after a crash
    # (the memo and the pending-first intake below make a retried call safe).
    RAY_OPTIONS = {"max_concurrency": 64, **RESTARTABLE}

    @built_with_gc_paused
    def __init__(self, cfg: AssemblerConfig, ctx: RunContext | None = None, *, consumer: str = "assembler-0"):
        self.cfg = cfg
        self.ctx = ctx or RunContext()
        setup_actor_logging(consumer, self.ctx)
        self.consumer = consumer
        self.buffer: dict[str, tuple[str, ScoredGroup]] = {}  # task_id -> (stream id, group)
        self.resolved: dict[str, str] = {}  # task_id -> outcome, for steps already assembled
        self.duplicates = 0
        self.undecodable = 0
        self.last_step = -1
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None  # the consumer loop (queues.worker.Worker.run)
        self.worker = self.conn = self.scored = self.batches = None

    async def start(self) -> None:
        """Connects to the run's streams (ctx.redis_url) and starts the consumer loop; every call that
        needs them starts it too, so an instance Ray restarted after a crash connects on its first call."""
        from queues.streams import RunStreams
        from queues.topology import ASSEMBLED, BATCHES, SCORED
        from queues.worker import Worker

        if self._task is not None:
            return
        if not self.ctx.redis_url:
            raise RuntimeError("assembler: its RunContext has no redis_url")
        self.conn = await RunStreams.open(self.ctx.redis_url, self.ctx.run_id)
        self.scored = self.conn.stream(SCORED)
        self.batches = self.conn.stream(BATCHES, high_water=self.ctx.stream_high_water)
        # Each assembled step's result, written before its groups are acked: a collect that Ray
        # retries on a restarted instance returns it instead of waiting for acked groups.
        self.memo = self.conn.hash(ASSEMBLED)
        await self.scored.ensure_group()
        await self.batches.ensure_group()
        for raw in await self.memo.values():  # a step's memo carries its outcomes; an eval's (collect_eval)
            self.resolved.update(json.loads(raw).get("outcomes", {}))  # only its scalars
        # The one consumer loop: this consumer's pending groups first (what it held when it died), then
        # new ones. It never acks: collect acks a step's groups once their TrainBatch is published.
        self.worker = Worker(self.scored, self.consumer, self._take, concurrency=64, read_count=64,
                             reclaim_idle_s=self.ctx.reclaim_idle_s, heartbeat=False, on_error="leave", acks="handler")
        self._task = asyncio.create_task(self.worker.run())

    async def _ensure_started(self) -> None:
        if self._task is None:
            await self.start()

    async def _memo_get(self, key: str) -> dict | None:
        raw = await self.memo.get(key)
        return json.loads(raw) if raw else None

    async def _memo_put(self, key: str, result: dict) -> None:
        await self.memo.put(key, json.dumps(result).encode())

    async def pid(self) -> int:
        return os.getpid()

    async def _take(self, msg_id: str, data: bytes) -> None:
        """The consumer loop's handler: buffers a scored group (acked by collect), or acks a duplicate."""
        try:
            group = codec(ScoredGroup).decode(data)
        except (SchemaError, msgspec.DecodeError) as e:
            self.undecodable += 1  # retrying it could never succeed; its task ends "failed" at its deadline
            log.error("assembler.undecodable_dropped", entry_id=msg_id, error=str(e)[:300])
            await self.scored.ack([msg_id])
            return
        task_id = group.rollout.task.task_id
        held = self.buffer.get(task_id)
        if held is not None and held[0] == msg_id:
            return  # our own unacked message, reclaimed back to us: it must stay pending until collect
        if held is not None or task_id in self.resolved:
            self.duplicates += 1
            await self.scored.ack([msg_id])
            return
        self.buffer[task_id] = (msg_id, group)
        self._arrived.set()

    async def wait_for(self, task_ids: list[str], timeout_s: float) -> list[str]:
        """Waits until every task has a scored group (or was resolved); returns the missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [t for t in task_ids if t not in self.buffer and t not in self.resolved]
            if not missing or time.monotonic() >= deadline:
                return missing
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(1.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def collect(self, step: int, task_ids: list[str], version: int, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Assembles `step` from its tasks' groups; publishes the TrainBatch; reports outcomes."""
        await self._ensure_started()
        done = await self._memo_get(str(step))
        if done is not None:  # a retried call (this actor restarted after assembling the step)
            return done
        missing = await self.wait_for(task_ids, timeout_s)
        outcomes: dict[str, str] = {t: self.resolved[t] for t in task_ids if t in self.resolved}
        for t in missing:
            outcomes[t] = FAILED  # never arrived within the step's deadline
        fresh = [t for t in task_ids if t in self.buffer]
        shaped = [apply_overlong(self.buffer[t][1], self.cfg) for t in fresh]
        kept: list[ScoredGroup] = []
        keep: list[list[bool]] = []
        overlong: dict[str, float] = {}
        for t, (g, k, counts) in zip(fresh, shaped):
            outcomes[t] = admit(g, version, self.cfg)
            for key, v in counts.items():
                overlong[key] = overlong.get(key, 0.0) + v
            if outcomes[t] == TRAINED:
                kept.append(g)
                keep.append(k)
        # Every task of the step has exactly one outcome (arrived or not): the ledger identity
        # prompts == sum of prompts_<outcome> holds on every step, timeouts included.
        if set(outcomes) != set(task_ids):
            raise RuntimeError(f"step {step}: outcomes for {len(outcomes)} tasks, {len(set(task_ids))} published")
        metrics = step_metrics([self.buffer[t][1] for t in fresh], outcomes)  # the rewards as scored
        metrics.update(staleness_metrics(kept, version))
        metrics["duplicates_ignored"] = float(self.duplicates)
        metrics.update(overlong)
        published = False
        if kept:
            batch = build_batch(step, version, kept, self.cfg, keep)
            batch.metrics = {"train_tokens": float(batch.num_tokens), "micro_batches": float(len(batch.micro_batches))}
            await self.batches.publish(codec(TrainBatch).encode(batch))
            metrics.update(batch.metrics)
            published = True
        result = {"outcomes": outcomes, "metrics": metrics, "published": published,
                  "reasons": {t: o for t, o in outcomes.items() if o != TRAINED}}
        await self._memo_put(str(step), result)
        self.last_step = step
        log.info("assembler.step", step=step, version=version, published=published,
                 **{f"prompts_{o}": int(metrics[f"prompts_{o}"]) for o in OUTCOMES}, prompts=len(outcomes))
        self.resolved.update(outcomes)
        await self.scored.ack([self.buffer[t][0] for t in fresh])
        for t in fresh:
            self.buffer.pop(t, None)
        return result

    async def peek(self, task_ids: list[str], version: int, timeout_s: float = 3600.0) -> dict[str, str]:
        """The outcome each task would get now (waits for their groups); changes nothing.

        The coordinator uses it to top up a step whose groups were filtered (replace_filtered);
        being side-effect free, a retry after a restart gives the same answer."""
        await self._ensure_started()
        missing = set(await self.wait_for(task_ids, timeout_s))
        return {t: (self.resolved[t] if t in self.resolved else FAILED if t in missing
                    else admit(self.buffer[t][1], version, self.cfg)) for t in task_ids}

    async def collect_eval(self, task_ids: list[str], timeout_s: float = 600.0) -> dict[str, float]:
        """Execution accuracy of greedy eval groups (never trained)."""
        await self._ensure_started()
        key = task_ids[0] if task_ids else "eval:"
        done = await self._memo_get(key)
        if done is not None:
            return done
        await self.wait_for(task_ids, timeout_s)
        groups = [self.buffer[t] for t in task_ids if t in self.buffer]
        verdicts = [g.verdicts[0] if g.verdicts else "failed" for _, g in groups]
        n = max(1, len(task_ids))
        rewards = [r for _, g in groups for r in g.rewards]
        result = {"eval_accuracy": sum(v == "match" for v in verdicts) / n,
                  "eval_valid_sql": sum(v in ("match", "wrong_result") for v in verdicts) / n,
                  "eval_answered": len(groups) / n,
                  # over every sample of every group (groups of n > 1: the sampled eval)
                  "eval_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
                  "eval_sample_accuracy": (sum(v == "match" for _, g in groups for v in g.verdicts)
                                           / max(1, sum(len(g.verdicts) for _, g in groups)))}
        await self._memo_put(key, result)
        self.resolved.update({t: "eval" for t in task_ids})
        await self.scored.ack([msg_id for msg_id, _ in groups])
        for t in task_ids:
            self.buffer.pop(t, None)
        return result

    async def forget_before(self, task_prefix_step: int) -> None:
        """Bounds the resolved map and the memo: drops steps older than the given step, and acks
        late duplicates of those steps still buffered."""
        await self._ensure_started()

        def old(t: str) -> bool:
            step = task_step(t)
            return step is not None and step < task_prefix_step
        self.resolved = {t: o for t, o in self.resolved.items() if not old(t)}
        stale = [t for t in self.buffer if old(t)]
        if stale:
            await self.scored.ack([self.buffer.pop(t)[0] for t in stale])
        await self.memo.delete(*[k for k in await self.memo.fields() if old(k)])

    def __repr__(self) -> str:  # the Ray dashboard's Repr column: live state
        g = lambda name, default=0: getattr(self, name, default)  # noqa: E731 - Ray may call it before __init__ ends
        return (f"Assembler({g('consumer', '?')}: last step {g('last_step', -1)}, {len(g('buffer', {}))} groups "
                f"buffered, {len(g('resolved', {}))} resolved, {g('duplicates')} duplicates ignored)")

    def stats(self) -> dict[str, float]:
        return {"buffered": float(len(self.buffer)), "duplicates_ignored": float(self.duplicates),
                "undecodable": float(self.undecodable)}

    async def stop(self) -> None:
        """Ends intake (within the worker's read bound); buffered groups stay pending in Redis."""
        if self._task is None:
            return
        self.worker.stop()
        done, _ = await asyncio.wait([self._task], timeout=5.0)
        if not done:
            self._task.cancel()
        elif not self._task.cancelled() and self._task.exception() is not None:
            log.warning("assembler.loop_failed", error=one_line(self._task.exception()))
        await self.conn.close()
