"""The scorer on a synthetic BIRD database: plain class, then the real Redis stream path."""
import asyncio

import pytest

from actors.scorer import Scorer, ScorerLoop
from config import ScorerConfig
from queues.messages import RolloutGroup, ScoredGroup, codec
from tests.builders import rollout_group, synthetic_question


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return synthetic_question(tmp_path_factory, "scorer", seed=2)


@pytest.fixture
def scorer():
    s = Scorer(ScorerConfig(workers=2, timeout_s=2.0, max_rows=1000, memory_mb=1024, temp_store_mb=64,
                            gold_cache_size=8), scorer_id="test-scorer")
    yield s
    s.close()


async def _streams(url: str, run: str):
    from queues.streams import Stream, connect
    from queues.topology import ROLLOUTS, SCORED

    redis = await connect(url)
    rollouts = Stream(redis, run, ROLLOUTS)
    scored = Stream(redis, run, SCORED)
    await rollouts.ensure_group()
    await scored.ensure_group()
    return redis, rollouts, scored


async def test_score_verdicts_rewards_and_stats(scorer, question):
    texts = [f"<think>easy</think>```sql\n{question.sql}\n```"] * 3 + ["```sql\nSELECT 42\n```", "no idea",
                                                                        "```sql\nSELEC broken\n```"]
    scored = await scorer.score(rollout_group(question, texts))
    assert scored.verdicts == ["match"] * 3 + ["wrong_result", "no_sql", "sql_error"]
    assert scored.rewards == [1.0] * 3 + [0.1, 0.0, 0.0]
    assert not scored.gold_failed and scored.scorer_id == "test-scorer" and scored.rollout.task.prompt_id == "p0"
    await scorer.score(rollout_group(question, texts[:1]))
    stats = scorer.stats()
    assert stats["groups"] == 2 and stats["gold_cache_misses"] == 1 and stats["gold_cache_hits"] == 1
    assert stats["pred_queries"] == 3 + 1 and stats["verdict/match"] == 4
    assert all(isinstance(v, float) for v in stats.values())


async def test_generation_error_and_gold_failed_groups(scorer, question):
    failed = await scorer.score(rollout_group(question, ["x", "y"], error="engine died"))
    assert failed.verdicts == ["generation_error"] * 2 and failed.rewards == [0.0, 0.0]
    bad_gold = await scorer.score(rollout_group(question, [f"```sql\n{question.sql}\n```"], gold_sql="SELECT nope FROM nowhere"))
    assert bad_gold.gold_failed and bad_gold.verdicts == ["gold_failed"]
    assert scorer.stats()["gold_failed_groups"] == 1


async def test_stream_path_scores_publishes_then_acks(scorer, question, tmp_path):
    from queues.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path) as server:
        redis, rollouts, scored = await _streams(server.url, "t1")
        enc = codec(RolloutGroup).encode
        for i in range(5):
            await rollouts.publish(enc(rollout_group(question, [f"```sql\n{question.sql}\n```", "nothing"], prompt_id=f"p{i}")))
        await rollouts.publish(b"\x93garbage")  # undecodable: acked and counted, never retried forever
        await rollouts.publish(b"\xc1")  # not even msgpack
        taken = await rollouts.consume("dead-scorer", count=1)  # a scorer that died holding p0
        assert len(taken) == 1
        loop = ScorerLoop(scorer, consumer="c1", reclaim_idle_s=0.3)
        task = asyncio.create_task(loop.run(server.url, "t1"))
        got = []
        for _ in range(100):
            got += await scored.consume("a1", count=10, block_ms=100)
            if len(got) >= 5:
                break
        loop.stop()
        await asyncio.wait_for(task, 5)
        groups = [codec(ScoredGroup).decode(d) for _, d in got]
        assert sorted(g.rollout.task.prompt_id for g in groups) == [f"p{i}" for i in range(5)]
        assert all(g.verdicts == ["match", "no_sql"] for g in groups)
        assert loop.undecodable == 2
        pending = await redis.xpending(rollouts.key, "scorers")
        assert pending["pending"] == 0  # every consumed message acked after its publish
        await redis.aclose()


async def test_one_slow_group_does_not_hold_back_the_others(question, tmp_path):
    """Head-of-line blocking: with 4 slots, groups that arrive while a 4 s query runs are scored
    at once (the old loop took nothing new until its whole batch, the slow group included, was done)."""
    from queues.redis_server import EmbeddedRedis

    slow_sql = "```sql\nWITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c\n```"
    # The endless query holds its worker until the 4 s timeout: long enough that fast groups beat it
    # even on a loaded machine, short enough for CI.
    scorer = Scorer(ScorerConfig(workers=2, timeout_s=4.0, max_rows=1000, memory_mb=1024, temp_store_mb=64),
                    scorer_id="hol")
    with EmbeddedRedis(tmp_path) as server:
        redis, rollouts, scored = await _streams(server.url, "t2")
        enc = codec(RolloutGroup).encode
        await rollouts.publish(enc(rollout_group(question, [slow_sql], prompt_id="slow")))
        loop = ScorerLoop(scorer, consumer="c1", batch=4)
        task = asyncio.create_task(loop.run(server.url, "t2"))
        order = []
        try:
            for _ in range(100):  # the slow group is taken: now the fast ones arrive
                if (await redis.xpending(rollouts.key, "scorers"))["pending"]:
                    break
                await asyncio.sleep(0.02)
            for i in range(3):
                await rollouts.publish(enc(rollout_group(question, [f"```sql\n{question.sql}\n```"], prompt_id=f"fast{i}")))
            for _ in range(200):
                for _, data in await scored.consume("a1", count=10, block_ms=50):
                    order.append(codec(ScoredGroup).decode(data).rollout.task.prompt_id)
                if len(order) == 4:
                    break
        finally:
            loop.stop()
            await asyncio.wait_for(task, 10)
            scorer.close()
            await redis.aclose()
        assert len(order) == 4
        assert order[-1] == "slow", f"fast groups waited behind the slow one: {order}"


async def test_a_database_outside_the_data_directory_is_never_opened(question, tmp_path):
    """A task from a shared Redis naming any other SQLite file gets "bad_db_path", is excluded like a
    failed gold, and the file is not opened; databases under the configured root score as usual."""
    import os
    import sqlite3

    outside = tmp_path / "secret.sqlite"
    sqlite3.connect(outside).close()
    before = os.stat(outside).st_atime_ns
    root = os.path.dirname(os.path.dirname(os.path.dirname(question.db_path)))
    s = Scorer(ScorerConfig(workers=1, timeout_s=2.0), scorer_id="root", db_root=root)
    try:
        ok = await s.score(rollout_group(question, [f"```sql\n{question.sql}\n```"]))
        assert ok.verdicts == ["match"] and not ok.gold_failed
        for path in (str(outside), os.path.join(root, "..", "secret.sqlite"), question.db_path + ".missing"):
            g = rollout_group(question, ["```sql\nSELECT 1\n```"])
            g.task.db_path = path
            bad = await s.score(g)
            assert bad.verdicts == ["bad_db_path"] and bad.rewards == [0.0] and bad.gold_failed, path
        assert s.stats()["verdict/bad_db_path"] == 3
    finally:
        s.close()
    assert os.stat(outside).st_atime_ns == before
