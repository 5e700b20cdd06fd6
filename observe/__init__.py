"""Observability every layer uses: structlog set-up (logs), scalar metrics to metrics.jsonl / W&B
(metrics) and Ray gauges (ray_metrics). Below actors and launch: it imports neither."""
