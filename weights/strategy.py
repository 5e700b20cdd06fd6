"""The one factory: coordinator.weight_sync -> a transport strategy.

Invariants:
- ``REGISTRY`` is the only list of transports: a kind -> "module:attribute" of a
  ``weights.protocol.Transport`` instance, imported on first use. Adding a transport is one new
  module plus one line here.
- ``transport_for`` takes the RESOLVED config (validation turned weight_sync="auto" into the
  placement's kind); a kind nobody registered is a one-line WeightSyncError naming the config key.
- The object store is what the transformers engine takes on CPU; resyncing a subset of generators
  over a collective transport falls back to it (``fallback``).
"""
from __future__ import annotations

import importlib
from typing import Any

from weights.protocol import Transport
from weights.wire import WeightSyncError

REGISTRY: dict[str, str] = {
    "object_store": "weights.store:TRANSPORT",
    "cuda_ipc": "weights.ipc:TRANSPORT",
    "nccl": "weights.nccl:TRANSPORT",
}


def get_transport(kind: str) -> Transport:
    """The transport registered for `kind` (coordinator.weight_sync)."""
    target = REGISTRY.get(kind)
    if target is None:
        raise WeightSyncError(f"config key 'coordinator.weight_sync': no transport {kind!r} "
                              f"(registered: {', '.join(sorted(REGISTRY))})")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def transport_for(coordinator_cfg: Any) -> Transport:
    """From the resolved coordinator config section (its weight_sync)."""
    kind = coordinator_cfg.weight_sync
    if kind == "auto":
        raise WeightSyncError("config key 'coordinator.weight_sync': still 'auto'; validate the config first")
    return get_transport(kind)


def fallback() -> Transport:
    """What a partial resync (some generators only) uses when the chosen transport is collective."""
    return get_transport("object_store")
