import msgspec
import numpy as np
import pytest

from queues.messages import (
    SCHEMA,
    Event,
    PromptTask,
    RolloutGroup,
    Sample,
    SchemaError,
    ScoredGroup,
    TrainBatch,
    TrainGroup,
    codec,
    oldest_version,
    pack_floats,
    pack_ids,
    sample_versions,
    unpack_floats,
    unpack_ids,
)


def _task():
    return PromptTask(task_id="3:1:0", prompt_id="q17", step=3, policy_version=2, prompt_tokens=pack_ids(range(3000)),
                      n=2, db_id="shop", db_path="/tmp/shop.sqlite", gold_sql="SELECT 1", sampling={"temperature": 0.0})


def _rollout():
    samples = [Sample(tokens=pack_ids([5, 6, 7]), logprobs=pack_floats([-0.1, -0.2, -0.3]), finish_reason="stop",
                      text="SELECT 1"), Sample(tokens=pack_ids([]), logprobs=b"", finish_reason="length")]
    return RolloutGroup(task=_task(), samples=samples, policy_version=2, generator_id="g0", started_at=1.0)


MESSAGES = [
    _task(),
    _rollout(),
    ScoredGroup(rollout=_rollout(), rewards=[1.0, 0.0], verdicts=["match", "no_sql"]),
    TrainBatch(step=3, policy_version=2, groups=[TrainGroup(prompt_id="q17", prompt_tokens=pack_ids([1, 2]),
               completions=[pack_ids([3])], gen_logprobs=[pack_floats([-1.0])], advantages=[0.5], rewards=[1.0],
               policy_version=2)], micro_batches=[[(0, 0)]], minibatches=[[0]], metrics={"x": 1.0}),
    Event(kind="dropped", source="assembler", step=3, prompt_id="q17", reason="stale"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(msg):
    c = codec(type(msg))
    assert c.decode(c.encode(msg)) == msg
    assert codec(type(msg)) is c  # one reused codec per type


def test_token_ids_travel_as_packed_int32_not_lists():
    ids = np.arange(3000, dtype=np.int64)
    assert unpack_ids(pack_ids(ids)).tolist() == ids.tolist()
    assert len(pack_ids(ids)) == 4 * 3000
    encoded = codec(PromptTask).encode(_task())
    # the 3,000-token prompt costs ~12 KB: bytes, not a msgpack array of ints
    assert 12_000 <= len(encoded) < 12_400
    np.testing.assert_allclose(unpack_floats(pack_floats([-0.5, 1.25])), [-0.5, 1.25])


def test_unknown_schema_is_refused_with_a_clear_error():
    future = msgspec.structs.replace(_task(), schema=SCHEMA + 1)
    with pytest.raises(SchemaError, match=f"schema {SCHEMA + 1}, this code reads schemas 1, 2, 3"):
        codec(PromptTask).decode(codec(PromptTask).encode(future))


def test_schema_1_groups_without_token_versions_still_decode_at_the_group_version():
    class OldSample(msgspec.Struct, kw_only=True):  # schema 1's Sample: no versions field
        tokens: bytes
        logprobs: bytes
        finish_reason: str
        text: str = ""

    class OldGroup(msgspec.Struct, kw_only=True):
        schema: int
        task: PromptTask
        samples: list[OldSample]
        policy_version: int

    old = OldGroup(schema=1, task=_task(), policy_version=4,
                   samples=[OldSample(tokens=pack_ids([5, 6, 7]), logprobs=pack_floats([-1, -2, -3]), finish_reason="stop")])
    group = codec(RolloutGroup).decode(msgspec.msgpack.encode(old))
    assert sample_versions(group.samples[0], group.policy_version).tolist() == [4, 4, 4]
    assert oldest_version(group) == 4
    # A partial rollout: per-token versions, the oldest is what admission counts.
    group.samples.append(Sample(tokens=pack_ids([1, 2, 3, 4]), logprobs=pack_floats([0] * 4), finish_reason="stop",
                                versions=pack_ids([3, 3, 4, 5])))
    again = codec(RolloutGroup).decode(codec(RolloutGroup).encode(group))
    assert oldest_version(again) == 3
    assert sample_versions(again.samples[1], again.policy_version).tolist() == [3, 3, 4, 5]
    with pytest.raises(ValueError, match="Sample.versions has 2 entries for 3 tokens"):
        sample_versions(Sample(tokens=pack_ids([1, 2, 3]), logprobs=b"", finish_reason="stop",
                               versions=pack_ids([1, 2])), 0)


def test_wrong_type_is_a_one_line_error():
    with pytest.raises(SchemaError, match="PromptTask"):
        codec(PromptTask).decode(codec(Event).encode(Event(kind="x", source="y")))
