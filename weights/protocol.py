"""The transport strategy's shape: what every transport (ours or vLLM's own) provides to both ends.

Invariants:
- A transport is one object with a sender half (built on the learner rank beside its weights) and a
  receiver half (built in the generator beside its engine); nothing else in the house knows its name.
- ``per_bucket`` transports are driven by the coordinator one message at a time
  (``weights.base.drive_bucketed_sync``: at most one bucket in flight); the others (a collective
  group) run one call per side per sync.
- Both halves keep the counting of weights.base: a partial sync never bumps the receiver's version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

IMPLS = ("ours", "vllm")  # coordinator.weight_sync_impl


@dataclass(frozen=True)
class TransportKey:
    """What picks a transport: the placement's kind (coordinator.weight_sync) and whose code moves it."""

    kind: str  # object_store | cuda_ipc | nccl
    impl: str = "ours"  # ours | vllm

    def __str__(self) -> str:
        return f"{self.kind}/{self.impl}"


class Transport:
    """One transport: a sender half and a receiver half. Subclasses set `key` and `per_bucket`."""

    key: TransportKey
    per_bucket: bool = True

    def make_sender(self, export_weights: Callable[..., Any], bucket_mb: float, *, rank: int = 0,
                    device: Any = None) -> Any:
        """Learner side. `export_weights(bucket_mb, device=...)` yields buckets of (name, tensor)."""
        raise NotImplementedError

    def make_receiver(self, load_weights: Callable[..., Any], engine: Any = None) -> Any:
        """Generator side. `engine` is given when it loads in its own worker processes (vLLM)."""
        raise NotImplementedError

    def merge(self, messages: list) -> Any:
        """Several learner ranks' messages for one bucket -> the one message receivers get
        (default: rank 0's; the others only took part in collective gathers)."""
        return messages[0]

    def all_ranks_send(self) -> bool:
        """Whether every learner rank holds a part of each bucket (CUDA IPC: each rank's own GPU)."""
        return False
