"""The one factory: coordinator.weight_sync -> a transport strategy.

Invariants:
- ``REGISTRY`` holds one transport per kind of the config's one list (config.schema.WEIGHT_SYNC_KINDS),
  by explicit imports: a kind without a transport, or a transport of no kind, fails at import. Adding
  a transport is one new module, its kind in that list and one line here.
- Importing this module (what the coordinator does) imports no torch: each transport module imports
  it where a step needs it.
- ``transport_for`` takes the RESOLVED config (validation turned weight_sync="auto" into the
  placement's kind); a kind nobody registered is a one-line WeightSyncError naming the config key.
- The object store is what the transformers engine takes on CPU; resyncing a subset of generators
  over a collective transport falls back to it (``fallback``).
"""
from __future__ import annotations

from typing import Any

from config.schema import WEIGHT_SYNC_KINDS
from weights import ipc, nccl, store
from weights.protocol import Transport
from weights.wire import WeightSyncError

REGISTRY: dict[str, Transport] = {t.key.kind: t for t in (store.TRANSPORT, ipc.TRANSPORT, nccl.TRANSPORT)}
if sorted(REGISTRY) != sorted(WEIGHT_SYNC_KINDS):
    raise ImportError(f"weights.strategy.REGISTRY has transports for {sorted(REGISTRY)}, "
                      f"config.schema.WEIGHT_SYNC_KINDS lists {sorted(WEIGHT_SYNC_KINDS)}")


def get_transport(kind: str) -> Transport:
    """The transport registered for `kind` (coordinator.weight_sync)."""
    transport = REGISTRY.get(kind)
    if transport is None:
        raise WeightSyncError(f"config key 'coordinator.weight_sync': no transport {kind!r} "
                              f"(registered: {', '.join(sorted(REGISTRY))})")
    return transport


def transport_for(coordinator_cfg: Any) -> Transport:
    """From the resolved coordinator config section (its weight_sync)."""
    kind = coordinator_cfg.weight_sync
    if kind == "auto":
        raise WeightSyncError("config key 'coordinator.weight_sync': still 'auto'; validate the config first")
    return get_transport(kind)


def fallback() -> Transport:
    """What a partial resync (some generators only) uses when the chosen transport is collective."""
    return store.TRANSPORT
