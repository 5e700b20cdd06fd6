"""CPU benches of one part each (streams, generation, scoring, overlap, learner, weight sync, async modes, preflight): run by hand, results in docs/perf/."""
