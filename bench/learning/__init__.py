"""Learning benches: whole tiny runs over seeds comparing recipes and objectives (held-out accuracy); results in docs/perf/tiny.md, objectives.md."""
