"""The learner as a group of ranks (CPU: processes over gloo, real Ray, real DeepSpeed): the split of
micro-batches across ranks, 2 ranks == 1 rank for every ZeRO stage, checkpoints of one world size."""
from __future__ import annotations

import random

import pytest

from policies.shard import split_across_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_split_runs_every_micro_batch_once_with_equal_calls_balanced_by_tokens(world_size):
    rng = random.Random(world_size)
    for n in [0, 1, 2, 3, 5, 7, 8, 13]:
        tokens = [rng.randint(1, 500) for _ in range(n)]
        split = split_across_ranks(tokens, world_size)
        assert len(split) == world_size
        assert {len(s) for s in split} == {max(1, -(-n // world_size))}  # the same number of calls each
        real = [i for s in split for i in s if i is not None]
        assert sorted(real) == list(range(n))  # every micro-batch exactly once
        for s in split:  # own micro-batches in their order, empty slots last
            mine = [i for i in s if i is not None]
            assert s == mine + [None] * (len(s) - len(mine)) and mine == sorted(mine)
        loads = [sum(tokens[i] for i in s if i is not None) for s in split]
        if n >= world_size:  # balanced: no rank is more than its largest micro-batch above the lightest
            assert max(loads) - min(loads) <= max(tokens), (tokens, split)
    # Greedy by tokens, not by position: the two heavy micro-batches go to different ranks.
    assert split_across_ranks([100, 90, 10, 5], 2) == [[0, 3], [1, 2]]
    assert split_across_ranks([1, 1, 1], 2) == [[0, 2], [1, None]]


def test_split_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="world_size"):
        split_across_ranks([1, 2], 0)
    with pytest.raises(ValueError, match="token counts"):
        split_across_ranks([1, -2], 2)
