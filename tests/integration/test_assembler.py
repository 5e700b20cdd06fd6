"""Assembler: outcomes, staleness, dedup and ack-after-publish, against a real redis-server."""
import asyncio

from actors.assembler import (
    FAILED,
    FILTERED,
    GOLD_FAILED,
    STALE,
    TRAINED,
    Assembler,
    admit,
    build_batch,
    staleness_metrics,
)
from config import AssemblerConfig, RunContext
from queues.messages import ScoredGroup, TrainBatch, codec, pack_ids
from queues.streams import Stream, connect
from queues.topology import BATCHES, SCORED
from tests.builders import scored


def test_every_group_gets_one_outcome():
    cfg = AssemblerConfig(max_staleness=1)
    assert admit(scored("a", [1.0, 0.0]), 0, cfg) == TRAINED
    assert admit(scored("b", [1.0, 1.0]), 0, cfg) == FILTERED
    assert admit(scored("c", [1.0, 0.0], version=0), 2, cfg) == STALE
    assert admit(scored("c", [1.0, 0.0], version=1), 2, cfg) == TRAINED
    assert admit(scored("d", [1.0, 0.0], gold_failed=True), 0, cfg) == GOLD_FAILED
    assert admit(scored("e", [], error="empty prompt"), 0, cfg) == FAILED


def test_a_partial_rollout_is_admitted_by_its_oldest_token_and_its_staleness_is_measured_per_token():
    cfg = AssemblerConfig(max_staleness=1)
    g = scored("p", [1.0, 0.0], version=2, completion_len=4)
    g.rollout.samples[0].versions = pack_ids([2, 2, 3, 4])  # continued across two weight updates
    g.rollout.policy_version = 2
    assert admit(g, 3, cfg) == TRAINED and admit(g, 4, cfg) == STALE  # the first token decides, not the last
    assert build_batch(0, 3, [g], cfg).groups[0].policy_version == 2
    m = staleness_metrics([g, scored("q", [1.0, 0.0], version=3, completion_len=2)], 4)
    # lags per token: [2, 2, 1, 0] + [2, 2, 2, 2] (second sample of g, at its group version) + [1, 1] x 2
    lags = [2, 2, 1, 0] + [2] * 4 + [1] * 4
    assert m["staleness_mean"] == sum(lags) / len(lags) and m["staleness_max"] == 2.0
    assert (m["tokens_lag0_frac"], m["tokens_lag1_frac"], m["tokens_lag2_frac"]) == (1 / 12, 5 / 12, 6 / 12)
    assert m["partial_samples_frac"] == 1 / 4
    assert staleness_metrics([], 0) == {"staleness_mean": 0.0, "staleness_max": 0.0, "partial_samples_frac": 0.0}


def test_batch_packs_every_kept_sample_once_within_budget():
    cfg = AssemblerConfig(micro_batch_tokens=20, minibatches_per_step=2)
    groups = [scored(str(i), [1.0, 0.0, 0.1], completion_len=3 + i) for i in range(4)]
    batch = build_batch(7, 3, groups, cfg)
    flat = sorted(pair for mb in batch.micro_batches for pair in mb)
    assert flat == [(g, s) for g in range(4) for s in range(3)]
    for mb in batch.micro_batches:
        assert sum(5 + 3 + g for g, _ in mb) <= 20
    assert sorted(i for m in batch.minibatches for i in m) == list(range(len(batch.micro_batches)))
    assert len(batch.minibatches) == 2
    for g in batch.groups:
        assert abs(sum(g.advantages)) < 1e-9  # group-normalised


async def test_collect_acks_only_after_the_batch_and_ignores_redelivery(redis_url):
    redis = await connect(redis_url)
    scored_stream = Stream(redis, "r", SCORED)
    await scored_stream.ensure_group()
    asm = Assembler(AssemblerConfig(), RunContext(run_id="r", redis_url=redis_url, reclaim_idle_s=0.2))
    await asm.start()
    enc = codec(ScoredGroup).encode
    for tid, rewards in [("0:0:0", [1.0, 0.0]), ("0:1:0", [0.0, 0.0])]:
        await scored_stream.publish(enc(scored(tid, rewards)))
    await asm.wait_for(["0:0:0", "0:1:0"], 5)
    await asyncio.sleep(0.6)  # longer than reclaim_idle: the assembler reclaims its own held messages
    assert (await scored_stream.depth())["pending"] == 2  # still unacked: nothing acked before the batch
    await scored_stream.publish(enc(scored("0:0:0", [1.0, 0.0])))  # a redelivered copy
    await asyncio.sleep(0.3)
    result = await asm.collect(0, ["0:0:0", "0:1:0", "0:2:0"], version=0, timeout_s=1.0)
    assert result["outcomes"] == {"0:0:0": TRAINED, "0:1:0": FILTERED, "0:2:0": FAILED}
    assert result["published"] and result["metrics"]["duplicates_ignored"] == 1
    m = result["metrics"]  # a group that never arrived is counted: prompts == sum of outcomes
    assert m["prompts"] == 3 and m["prompts_failed"] == 1
    assert m["prompts"] == sum(m[f"prompts_{o}"] for o in (TRAINED, FILTERED, STALE, GOLD_FAILED, FAILED))
    assert (await scored_stream.depth())["pending"] == 0
    batches = Stream(redis, "r", BATCHES)
    [(_, data)] = await batches.consume("l", count=5, block_ms=100)
    batch = codec(TrainBatch).decode(data)
    assert batch.step == 0 and [g.prompt_id for g in batch.groups] == ["q0:0:0"]
    await asm.stop()


async def test_forget_before_prunes_train_and_eval_state(redis_url):
    """resolved and the memo stay bounded over a long run: eval tasks ("eval:<step>:g<k>") are
    pruned like training tasks (they used to stay for the whole run)."""
    redis = await connect(redis_url)
    scored_stream = Stream(redis, "f", SCORED)
    await scored_stream.ensure_group()
    asm = Assembler(AssemblerConfig(), RunContext(run_id="f", redis_url=redis_url))
    await asm.start()
    enc = codec(ScoredGroup).encode
    for tid in ("0:0:0", "eval:0:g0", "3:0:0", "eval:3:g0"):
        await scored_stream.publish(enc(scored(tid, [1.0, 0.0])))
    await asm.collect(0, ["0:0:0"], version=0, timeout_s=5.0)
    await asm.collect_eval(["eval:0:g0"], timeout_s=5.0)
    await asm.collect(3, ["3:0:0"], version=0, timeout_s=5.0)
    await asm.collect_eval(["eval:3:g0"], timeout_s=5.0)
    assert set(asm.resolved) == {"0:0:0", "eval:0:g0", "3:0:0", "eval:3:g0"}
    await asm.forget_before(2)
    assert set(asm.resolved) == {"3:0:0", "eval:3:g0"}
    memo = {k.decode() for k in await redis.hkeys(asm.memo.key)}
    assert memo == {"3", "eval:3:g0"}
    assert "last step 3" in repr(asm) and "2 resolved" in repr(asm)  # the dashboard's Repr column
    await asm.stop()


async def test_a_restarted_assembler_starts_over_a_memo_that_holds_an_eval(redis_url):
    """The memo holds steps' results and evals' (keyed by their first task id, scalars only): a restarted
    instance restores the steps' outcomes and answers a retried eval from the memo (the hour's soak found
    a restart after an evaluation failing with KeyError 'outcomes' and ending the run)."""
    redis = await connect(redis_url)
    scored_stream = Stream(redis, "m", SCORED)
    await scored_stream.ensure_group()
    ctx = RunContext(run_id="m", redis_url=redis_url)
    first = Assembler(AssemblerConfig(), ctx)
    await first.start()
    enc = codec(ScoredGroup).encode
    for tid in ("0:0:0", "eval:0:g0"):
        await scored_stream.publish(enc(scored(tid, [1.0, 0.0])))
    step = await first.collect(0, ["0:0:0"], version=0, timeout_s=5.0)
    ev = await first.collect_eval(["eval:0:g0"], timeout_s=5.0)
    await first.stop()
    again = Assembler(AssemblerConfig(), ctx)  # as Ray restarts it: a fresh instance, the same run
    await again.start()
    assert again.resolved == {"0:0:0": TRAINED}
    assert await again.collect(0, ["0:0:0"], version=0, timeout_s=1.0) == step
    assert await again.collect_eval(["eval:0:g0"], timeout_s=1.0) == ev
    await again.stop()
