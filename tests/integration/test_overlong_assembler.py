"""Overlong handling in the assembler's collect over a real redis-server: the step's metrics count the truncated and
penalised samples and report the rewards as scored."""
from actors.assembler import TRAINED, Assembler
from config import AssemblerConfig, RunContext
from queues.messages import ScoredGroup, codec
from queues.streams import Stream, connect
from queues.topology import SCORED
from tests.builders import overlong_group


async def test_collect_reports_overlong_counts_and_scored_rewards(redis_url):
    redis = await connect(redis_url)
    stream = Stream(redis, "ol", SCORED)
    await stream.ensure_group()
    asm = Assembler(AssemblerConfig(overlong="soft_penalty", max_tokens=8, overlong_buffer=4),
                    RunContext(run_id="ol", redis_url=redis_url))
    await asm.start()
    g = overlong_group([3, 8], [1.0, 1.0], [False, True])
    await stream.publish(codec(ScoredGroup).encode(with_task_id(g, "0:0:0")))
    result = await asm.collect(0, ["0:0:0"], version=0, timeout_s=5.0)
    m = result["metrics"]
    assert result["outcomes"] == {"0:0:0": TRAINED}
    assert m["overlong_truncated"] == 1.0 and m["overlong_penalised"] == 1.0 and m["overlong_penalty_sum"] == -1.0
    assert m["reward_mean"] == 1.0  # the reward as scored; the penalty is its own metric
    await asm.stop()


def with_task_id(g, task_id):
    g.rollout.task.task_id = task_id
    return g

