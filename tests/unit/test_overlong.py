"""Overlong handling (policies/overlong.py, DAPO) and its assembler wiring: penalties by hand, truncated
samples cut after their group's advantages, counts in the step's metrics, config errors in one line."""
import pytest
import torch

from actors.assembler import FILTERED, TRAINED, admit, apply_overlong, build_batch
from config import AssemblerConfig, ConfigError
from config.validate import validate
from policies.grpo import group_advantages
from policies.overlong import shape, soft_penalty
from queues.messages import TrainBatch, codec, pack_ids
from tests.builders import overlong_group


def test_soft_penalty_by_hand():
    # L_max = 100, L_cache = 20: free up to 80, then linear down to -1 at 100, -1 beyond.
    assert [soft_penalty(n, 100, 20) for n in (1, 80, 81, 90, 100, 101)] == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    pens = [soft_penalty(n, 100, 20) for n in range(0, 130)]
    assert all(-1 <= p <= 0 for p in pens) and all(a >= b for a, b in zip(pens, pens[1:]))


def test_shape_modes():
    rewards, lengths, trunc = [1.0, 0.0, 1.0], [10, 95, 100], [False, False, True]
    assert shape(rewards, lengths, trunc, "none", 100, 20) == (rewards, [True] * 3, {
        "overlong_truncated": 1.0, "overlong_filtered": 0.0, "overlong_penalised": 0.0, "overlong_penalty_sum": 0.0})
    r, keep, c = shape(rewards, lengths, trunc, "soft_penalty", 100, 20)
    assert r == [1.0, -0.75, 0.0] and keep == [True] * 3
    assert c["overlong_penalised"] == 2.0 and c["overlong_penalty_sum"] == -1.75
    r, keep, c = shape(rewards, lengths, trunc, "filter", 100, 20)
    assert r == rewards and keep == [True, True, False] and c["overlong_filtered"] == 1.0
    with pytest.raises(ValueError, match="overlong mode 'drop'"):
        shape(rewards, lengths, trunc, "drop", 100, 20)


def test_none_is_todays_assembler_exactly():
    cfg = AssemblerConfig(max_tokens=8, overlong_buffer=4)
    g = overlong_group([3, 8, 8], [1.0, 0.0, 1.0], [False, True, True])
    same, keep, counts = apply_overlong(g, cfg)
    assert same is g and keep == [True] * 3 and counts == {}
    assert codec(TrainBatch).encode(build_batch(0, 0, [g], cfg, [keep])) == codec(TrainBatch).encode(build_batch(0, 0, [g], cfg))


def test_filter_cuts_truncated_samples_after_the_advantages():
    cfg = AssemblerConfig(overlong="filter", max_tokens=8, overlong_buffer=4, share_prompt=False)
    g = overlong_group([3, 8, 5, 8], [1.0, 0.0, 0.0, 1.0], [False, True, False, True])
    shaped, keep, counts = apply_overlong(g, cfg)
    assert keep == [True, False, True, False] and counts["overlong_filtered"] == 2.0
    batch = build_batch(0, 0, [shaped], cfg, [keep])
    full, _ = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64))
    assert batch.groups[0].advantages == pytest.approx([float(full[0, 0]), float(full[0, 2])])
    assert [len(c) // 4 for c in batch.groups[0].completions] == [3, 5]
    assert sorted(p for mb in batch.micro_batches for p in mb) == [(0, 0), (0, 1)]
    assert admit(overlong_group([8, 8], [1.0, 0.0], [True, True]), 0, cfg) == FILTERED  # nothing left to train


def test_soft_penalty_gives_equal_rewards_a_signal_and_counts_the_budget_s_tokens():
    cfg = AssemblerConfig(overlong="soft_penalty", max_tokens=8, overlong_buffer=4)
    g = overlong_group([3, 8], [1.0, 1.0], [False, True])
    assert admit(g, 0, cfg) == FILTERED  # as scored: zero variance
    shaped, _, _ = apply_overlong(g, cfg)
    assert shaped.rewards == [1.0, 0.0] and admit(shaped, 0, cfg) == TRAINED
    ep = overlong_group([8, 3], [1.0, 1.0], [False, False])
    ep.rollout.samples[0].loss_mask = pack_ids([1, 1, 0, 0, 0, 0, 1, 1])  # observations count against max_tokens
    assert apply_overlong(ep, cfg)[0].rewards == [0.0, 1.0]


def test_config_resolves_the_buffer_and_refuses_bad_values():
    cfg = validate({"assembler": {"overlong": "soft_penalty"}, "generator": {"max_tokens": 200}})
    assert (cfg.assembler.max_tokens, cfg.assembler.overlong_buffer) == (200, 50)
    assert validate({"assembler": {"overlong_buffer": 30}}).assembler.overlong_buffer == 30
    for bad, key in (({"overlong": "cut"}, "assembler.overlong"), ({"overlong_buffer": -1}, "assembler.overlong_buffer")):
        with pytest.raises(ConfigError, match=key) as e:
            validate({"assembler": bad, "generator": {"max_tokens": 200}})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="assembler.overlong_buffer"):
        validate({"assembler": {"overlong_buffer": 200}, "generator": {"max_tokens": 200}})


