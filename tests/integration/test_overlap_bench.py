"""Smoke test of bench/cpu/overlap.py's core at a tiny size: both modes run the real generator ->
scorer -> assembler path (simulated engine, real Redis, real SQLite) and report sane timings."""
import asyncio
import importlib.util
import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "cpu", "overlap.py")


def _load_overlap_module():
    spec = importlib.util.spec_from_file_location("bench_overlap", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_overlap_benchmark_tiny_simulated_engine(tmp_path):
    overlap = _load_overlap_module()
    settings = overlap.OverlapSettings(prompts=3, samples=16, workers=2, scale=2, tick_s=0.0005, per_seq_s=0.0,
                                       mean_response_tokens=200.0, max_tokens=1000)
    out = asyncio.run(overlap.run_overlap(settings, str(tmp_path)))
    for mode in overlap.MODES:
        r = out["results"][mode]
        assert r.groups == 3 and r.samples == 48 and r.published
        assert r.samples_with_sql == 45  # one answer without SQL per group
        assert r.pred_queries_run == 3 * 13  # gold text 3x -> run once, 12 distinct variants
        assert r.gold_queries_run == 3
        assert r.verdicts["no_sql"] == 3 and r.verdicts["match"] >= 9 and sum(r.verdicts.values()) == 48
        assert 0 < r.generation_s <= r.step_s and r.exposed_scoring_s >= 0
        assert len(r.query_seconds) == 3 + 3 * 13  # every query the pool ran after warm-up, timed
    assert "per-prompt streaming" in overlap.format_table(out)


def test_overlap_benchmark_one_endless_query_times_out_once(tmp_path):
    """--slow-query-s: one sample of the step runs an endless query, cut by the scorer's timeout."""
    overlap = _load_overlap_module()
    settings = overlap.OverlapSettings(prompts=3, samples=8, workers=2, scale=2, tick_s=0.0005, per_seq_s=0.0,
                                       mean_response_tokens=200.0, max_tokens=1000, slow_query_s=1.0)
    r = asyncio.run(overlap.run_overlap(settings, str(tmp_path), modes=("stream",)))["results"]["stream"]
    assert r.verdicts.get("timeout") == 1 and r.published
    assert max(r.query_seconds) >= 1.0
    assert len(r.other_groups_latency_s) == 2 and min(r.other_groups_latency_s) >= 0
