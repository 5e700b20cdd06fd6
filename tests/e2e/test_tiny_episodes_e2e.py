"""CI's short multi-turn run (issue 24): `launch.cluster tiny generator.max_turns=3` with tiny_mt's warm
start (error-then-fix episodes, so the model writes tool blocks), 3 GRPO steps end to end on CPU. Fails
when observations are not fed back (no step with turns_mean > 1 and observation tokens) or not masked
(the learner's rows hold no loss-masked observation tokens: train_num_obs_tokens, from the masks)."""
from tests.tiny_runs import run_tiny

MT = ("generator.max_turns=3", "model.tiny_sft_episodes=0.5", "generator.max_tokens=160",
      "generator.max_observation_tokens=32", "assembler.micro_batch_tokens=8192")
EPISODE_METRICS = ("turns_mean", "turns_max", "tool_use_frac", "obs_tokens_mean", "tool_errors", "executor_wait_s",
                   "revision_gain")


def test_tiny_multi_turn_run_feeds_observations_back_and_masks_them(tmp_path):
    rows = run_tiny(tmp_path, "mt", *MT, steps=3, sft_steps=60)
    for r in rows:
        assert all(isinstance(r[k], (int, float)) for k in EPISODE_METRICS), r
        assert 1 <= r["turns_mean"] <= r["turns_max"] <= 3 and 0 <= r["tool_use_frac"] <= 1, r
    fed_back = [r for r in rows if r["turns_mean"] > 1 and r["obs_tokens_mean"] > 0 and r["executor_wait_s"] > 0]
    assert fed_back, [(r["turns_mean"], r["obs_tokens_mean"]) for r in rows]
    assert sum(r["train_num_obs_tokens"] for r in rows) > 0, [r["train_num_obs_tokens"] for r in rows]
