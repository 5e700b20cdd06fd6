"""The service benches: batching throughput, the Ray Serve hop, load with hostile clients (launch.serve); results in docs/perf/serve.md and docs/reliability/serve.md."""
