from observe import ray_metrics


def test_export_is_a_noop_without_ray():
    ray_metrics._gauges.clear()
    ray_metrics.export("x", {"reward_mean": 0.5})
    assert ray_metrics._gauges == {}


def test_counters_become_ray_gauges(local_ray):
    ray_metrics._gauges.clear()
    ray_metrics.export("generator-0", {"generator_tokens_per_s": 12.5, "queue/rollouts length": 3})
    assert set(ray_metrics._gauges) == {"arl_generator_tokens_per_s", "arl_queue_rollouts_length"}
