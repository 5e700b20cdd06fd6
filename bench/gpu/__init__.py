"""GPU benches (vLLM weight sync, the one-GPU recipes, the learner on H200, prompt sharing, episodes, warm starts, exports): run on the device, results in docs/perf/."""
