"""The generator's tool executor (tasks/executor.py) beyond tests/integration/test_episode.py's read-only / timeout
/ counting check: the row cap, a runaway query holding one worker while another episode's query
answers, a closed pool answering one line instead of raising, and run()'s own bound on a stuck pool."""
import asyncio

import pytest

from policies import episode as ep
from tasks import executor as executor_mod
from tasks.executor import ToolExecutor
from tests.builders import synthetic_question


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return synthetic_question(tmp_path_factory, "episode", seed=3)

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c"


def test_workers_below_one_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match="generator.tool_workers must be >= 1, got 0"):
        ToolExecutor(workers=0)


async def test_row_cap_and_a_runaway_query_holds_only_its_own_worker(question):
    ex = ToolExecutor(workers=2, timeout_s=3.0, max_rows=2)
    try:
        capped = await ex.run(question.db_path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c "
                                                "WHERE x < 50) SELECT x FROM c")
        assert capped.status == "too_many_rows" and capped.rows == []
        assert "\n" not in ep.observation_text(capped.status, capped.columns, capped.rows, capped.error)
        runaway = asyncio.create_task(ex.run(question.db_path, ENDLESS))
        await asyncio.sleep(0.2)  # the runaway query holds one worker
        quick = await ex.run(question.db_path, "SELECT 1")
        assert quick.status == "ok" and quick.rows == [(1,)] and not runaway.done()
        assert (await runaway).status == "timeout"
        s = ex.stats()
        assert (s["tool_queries"], s["tool_errors"]) == (3, 2) and s["executor_wait_s"] >= quick.seconds > 0
    finally:
        ex.close()


async def test_a_closed_pool_answers_one_error_line_and_counts_it(question):
    ex = ToolExecutor(workers=1, timeout_s=2.0)
    ex.close()
    r = await ex.run(question.db_path, "SELECT 1")
    assert r.status == "error" and r.error == "SqlPool is closed" and ex.stats()["tool_errors"] == 1


async def test_a_stuck_pool_fake_still_answers_within_the_executor_s_bound(question, monkeypatch):
    """A pool that never answers (a stand-in: the real pool kills its stuck workers itself) still gives
    run() a 'timeout' after timeout_s + GRACE_S, counted as an error and as wait."""
    ex = ToolExecutor(workers=1, timeout_s=0.1)
    never = asyncio.Event()

    async def stuck_pool_fake(db_path, sql):
        await never.wait()

    monkeypatch.setattr(executor_mod, "GRACE_S", 0.1)
    monkeypatch.setattr(ex.pool, "run", stuck_pool_fake)
    try:
        r = await asyncio.wait_for(ex.run(question.db_path, "SELECT 1"), 30)
        assert r.status == "timeout" and r.error == "exceeded 0.1 s" and r.seconds >= 0.2
        assert ex.stats()["tool_errors"] == 1 and ex.stats()["executor_wait_s"] >= 0.2
    finally:
        ex.close()
