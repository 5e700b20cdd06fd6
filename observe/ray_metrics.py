"""Actors' counters as Ray metrics (the dashboard's Metrics view / Prometheus endpoint).

Gauges are created lazily, one per metric name, and tagged with the actor; values are the same
scalars that go to metrics.jsonl. Outside a Ray worker this is a no-op.
"""
from __future__ import annotations

import asyncio
import re

_gauges: dict[str, object] = {}


def _name(key: str) -> str:
    return "arl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def export(actor: str, values: dict[str, float]) -> None:
    try:
        import ray
        from ray.util.metrics import Gauge

        if not ray.is_initialized():
            return
        for key, value in values.items():
            name = _name(key)
            gauge = _gauges.get(name)
            if gauge is None:
                gauge = _gauges[name] = Gauge(name, description=key, tag_keys=("actor",))
            gauge.set(float(value), tags={"actor": actor})
    except Exception:  # noqa: BLE001 - metrics must never take an actor down
        pass


async def export_periodically(actor: str, stats, period_s: float = 5.0) -> None:
    """Runs beside an actor's loop: exports `stats()` every `period_s` seconds."""
    while True:
        await asyncio.sleep(period_s)
        export(actor, stats())
