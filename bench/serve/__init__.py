"""The service benches: batching throughput, the Ray Serve hop, load with hostile clients (launch.serve); results under docs/."""
