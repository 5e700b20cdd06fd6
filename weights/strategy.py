"""The one factory: (coordinator.weight_sync, coordinator.weight_sync_impl) -> a transport strategy.

Invariants:
- ``REGISTRY`` is the only list of transports: a key (kind, impl) -> "module:attribute" of a
  ``weights.protocol.Transport`` instance, imported on first use (so the vLLM-native module is
  imported only where it runs). Adding a transport is one new module plus one line here.
- ``transport_for`` takes the RESOLVED config (validation turned weight_sync="auto" into the
  placement's kind) and the engine's name; a combination nobody registered, or vLLM's own transfer
  with an engine other than vLLM, is a one-line WeightSyncError naming the config keys.
- The object store is ours only and is what the transformers engine takes on CPU; resyncing a
  subset of generators over a collective transport falls back to it (``fallback``).
"""
from __future__ import annotations

import importlib
from typing import Any

from weights.protocol import IMPLS, Transport, TransportKey
from weights.wire import WeightSyncError

REGISTRY: dict[TransportKey, str] = {
    TransportKey("object_store", "ours"): "weights.store:TRANSPORT",
    TransportKey("cuda_ipc", "ours"): "weights.ipc:TRANSPORT",
    TransportKey("nccl", "ours"): "weights.nccl:TRANSPORT",
    TransportKey("cuda_ipc", "vllm"): "weights.vllm_native:TRANSPORT",
}


def get_transport(kind: str, impl: str = "ours", engine: str | None = None) -> Transport:
    """The transport registered for (kind, impl); `engine` (generator.engine) is checked against it."""
    if impl not in IMPLS:
        raise WeightSyncError(f"config key 'coordinator.weight_sync_impl': {impl!r} is not one of {list(IMPLS)}")
    if impl == "vllm" and engine not in (None, "vllm"):
        raise WeightSyncError(f"config key 'coordinator.weight_sync_impl': 'vllm' (vLLM's own weight transfer) "
                              f"needs generator.engine=vllm, not {engine!r}; use 'ours'")
    key = TransportKey(kind, impl)
    target = REGISTRY.get(key)
    if target is None:
        have = ", ".join(sorted(str(k) for k in REGISTRY))
        raise WeightSyncError(f"config keys 'coordinator.weight_sync'/'weight_sync_impl': no transport {key} "
                              f"(registered: {have})")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def transport_for(coordinator_cfg: Any, engine: str | None = None) -> Transport:
    """From the resolved coordinator config section (weight_sync, weight_sync_impl)."""
    kind = coordinator_cfg.weight_sync
    if kind == "auto":
        raise WeightSyncError("config key 'coordinator.weight_sync': still 'auto'; validate the config first")
    return get_transport(kind, getattr(coordinator_cfg, "weight_sync_impl", "ours"), engine)


def fallback() -> Transport:
    """What a partial resync (some generators only) uses when the chosen transport is collective."""
    return get_transport("object_store", "ours")
