"""bench/cpu/async_modes.py at toy size: the real Coordinator, Generator(SimulatedEngine), Assembler and Redis
run colocated and async with partial rollouts; every prompt is accounted for, the async boundary
interrupts in-flight requests and their samples span two versions, staleness stays within bounds."""
from bench.cpu.async_modes import main


def test_async_modes_bench_runs_and_partial_rollouts_cross_the_boundary(tmp_path):
    results = main(["--prompts", "4", "--samples", "4", "--steps", "4", "--mean-response-tokens", "60",
                    "--tick-s", "0.005", "--prompt-tokens", "20", "--train-s-per-ktok", "0.001", "--sync-s", "0.02",
                    "--sleep-wake-s", "0.05", "--modes", "colocated", "async_s2_partial",
                    "--json", str(tmp_path / "modes.json")])
    by = {r["mode"]: r for r in results}
    assert all(r["accounting_holds"] and r["prompts_stale"] == 0 and r["samples_per_s"] > 0 for r in results)
    assert by["colocated"]["interrupted_requests"] == 0 and by["colocated"]["staleness_max"] == 0
    partial = by["async_s2_partial"]
    # Training is far shorter than generation here: after step 1 (measured steps are 1..3) step 3 was
    # just published and is mid-flight at the boundary.
    assert partial["interrupted_requests"] > 0 and partial["partial_samples_frac"] > 0
    assert 0 < partial["staleness_mean"] <= partial["staleness_max"] <= 2
    assert (tmp_path / "modes.json").exists()
