"""Weight sync: the learner's weights into every generator's engine, one bounded bucket at a time.

A transport is ONE strategy object (a ``weights.protocol.Transport`` subclass) that says what happens
at each of the four places a sync crosses: the coordinator (``sync``), the learner group (``fan_out``,
``merge``), a learner rank (its sender half), a generator (its receiver half) and, for an engine that
loads in its own worker processes (vLLM), each worker. Each step is a typed message (``SenderStep``,
``ReceiverStep``, ``WorkerStep``) whose ``run`` calls the strategy's method for it. ONE factory picks
the strategy from the resolved config (``weights.strategy.transport_for``: coordinator.weight_sync).
The house around it has two verbs: the learner's ``send_weights(call)`` and the generator's
``receive_weights(call)`` (and the vLLM worker extension's ``arl_weights``), each forwarding a
``WeightsCall`` (the transport's key and one step) to its end (``weights.endpoint``).

**Adding a transport touches weights/ and the config's one list of kinds, and no existing class:**
one new module with its ``Transport`` subclass, its steps and (as the existing ones have) a sender
and a receiver class; its kind in ``config.schema.WeightSyncKind`` (what a user sets in
``coordinator.weight_sync``); one line in ``weights.strategy.REGISTRY``, which refuses to import when
the two disagree. No shell, engine, learner group or coordinator method changes.

This module is the one name callers import (``import weights as weight_sync``); the code lives
in one file per concern, each with its invariants in its docstring, and each name here is imported
from its module on first use (importing ``weights`` or ``weights.base`` imports no torch):

- ``wire``: the wire format every transport shares (``BucketPlan`` header + one flat uint8 buffer
  per dtype; flatten / unflatten / validate; messages and their schema).
- ``base``: the counting both ends share (a partial sync never bumps the version; at most ~2 buckets
  held by the sender) and ``drive_bucketed_sync``, the coordinator's loop for per-bucket transports.
- ``protocol``: the Transport shape, the step bases, ``WeightsCall`` and the coordinator's ``Link``;
  ``strategy``: the registry + factory; ``endpoint``: the learner rank's and the generator's ends.
- ``bucketed``: the per-bucket protocol (steps Start / Next / Abort / Receive, its ``sync``) that
  ``store`` and ``ipc`` share.
- ``store``: the Ray object store (CPU, and the fallback).
- ``ipc``: CUDA IPC on the same physical GPU; ``merge_ipc_buckets`` merges the learner ranks'
  buckets into one message with the handles keyed by device uuid, and each receiver (a vLLM worker,
  the transformers engine) opens only its own GPU's handle.
- ``broadcast``: a private NCCL (GPU) / gloo (CPU) group, learner rank 0 sending; ``nccl``: that
  transport's strategy and steps (the group built whole, rebuilt when a member is missing).

vLLM's own weight-transfer engines (``vllm.distributed.weight_transfer``) once stood behind the same
halves; measured against ``ipc`` on the H200 they were 3.1x slower per sync at equal memory
(docs/PERFORMANCE.md, issue 23), so their code was removed.

Which transport runs follows from the placement (``CoordinatorConfig.weight_sync``): colocated GPU
-> cuda_ipc, disaggregated GPU -> nccl, CPU -> object_store.
"""
from __future__ import annotations

from typing import Any

# name -> the module that defines it, imported on first use (PEP 562): `from weights.base import ...`
# (the coordinator's path) loads weights.base and weights.wire only; no module here imports torch at import.
_HOMES = {
    "weights.base": ("ReceiverBase", "SenderBase", "drive_bucketed_sync", "maybe_await"),
    "weights.bucketed": ("Abort", "BucketedTransport", "Next", "Receive", "Start"),
    "weights.broadcast": ("BroadcastReceiver", "BroadcastSender", "Rendezvous", "group_layout", "node_ip"),
    "weights.ipc": ("CudaIpcBucket", "CudaIpcReceiver", "CudaIpcSender", "device_uuid", "ipc_message_from_bytes",
                    "ipc_message_to_bytes", "load_ipc_bucket", "merge_ipc_buckets", "open_ipc_buffers",
                    "select_ipc_handles", "visible_cuda_uuids"),
    "weights.protocol": ("Link", "ReceiverStep", "SenderStep", "Transport", "TransportKey", "WeightsCall",
                         "WorkerStep", "verb"),
    "weights.store": ("ObjectStoreBucket", "ObjectStoreReceiver", "ObjectStoreSender"),
    "weights.wire": ("DTYPES", "MB", "WEIGHT_SYNC_SCHEMA", "BucketPlan", "Expected", "ExportWeights", "LoadWeights",
                     "NamedTensors", "SyncAbort", "SyncMessage", "SyncSummary", "TensorMeta", "WeightSyncError",
                     "bucket_to_payload", "decode_message", "dtype_name", "encode_message", "expected_from_named",
                     "flatten_bucket", "iter_buckets", "normalise_expected", "payload_and_plan", "payload_to_tensors",
                     "unflatten_bucket", "validate_plan"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'weights' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "make_receiver", "Link", "Transport", "TransportKey", "WeightsCall", "verb", "SenderStep", "ReceiverStep",
    "WorkerStep", "BucketedTransport", "Start", "Next", "Abort", "Receive",
    "BroadcastReceiver", "BroadcastSender", "BucketPlan", "CudaIpcBucket", "CudaIpcReceiver", "CudaIpcSender",
    "DTYPES", "Expected", "ExportWeights", "LoadWeights", "MB", "NamedTensors", "ObjectStoreBucket",
    "ObjectStoreReceiver", "ObjectStoreSender", "ReceiverBase", "Rendezvous", "SenderBase", "SyncAbort",
    "SyncMessage", "SyncSummary", "TensorMeta", "WEIGHT_SYNC_SCHEMA", "WeightSyncError", "bucket_to_payload",
    "decode_message", "device_uuid", "drive_bucketed_sync", "dtype_name", "encode_message", "expected_from_named",
    "flatten_bucket", "group_layout", "ipc_message_from_bytes", "ipc_message_to_bytes", "iter_buckets", "load_ipc_bucket",
    "maybe_await", "merge_ipc_buckets", "node_ip", "normalise_expected", "open_ipc_buffers", "payload_and_plan",
    "payload_to_tensors", "select_ipc_handles", "unflatten_bucket", "validate_plan", "visible_cuda_uuids",
]


def make_receiver(kind: str, load_weights: Any, engine: Any = None) -> Any:
    """The receiver half of a per-bucket transport (weights.strategy); `engine` (one that loads in its
    own workers) gets the messages themselves: the merged IPC bucket, or the checked plan and raw buffers."""
    from weights.strategy import get_transport

    transport = get_transport(kind)
    if not transport.per_bucket:
        raise ValueError(f"coordinator.weight_sync {kind!r} is not a per-bucket transport (object_store, cuda_ipc)")
    return transport.make_receiver(load_weights, engine)
