"""The two ends a shell holds: a learner rank's ``SendEnd`` and a generator's ``ReceiveEnd``.

The learner rank's one verb is ``send_weights(call)`` -> ``SendEnd.handle(call)``; the generator's is
``receive_weights(call)`` -> ``ReceiveEnd.handle(call)``; a vLLM worker's is the extension's
``arl_weights(kind, step)`` -> ``on_worker``. Each looks the transport up in the one factory
(weights.strategy) and hands it the step; the transport keeps its halves in the end's ``halves``.

Invariants:
- An end holds no transport logic and knows no transport by name: adding a transport never touches
  this module or a shell.
- The halves persist between calls, one slot per (transport key, role), so a per-bucket sender keeps
  its export iterator between `next` steps and a collective receiver keeps its group between syncs.
- A sender step marked blocking (a collective, a wait on peers: ``SenderStep.blocking``) runs in a
  thread, so the learner actor still answers its other calls meanwhile.
- ``ReceiveEnd.handle`` returns (reply, version completed or None): the shell ends the engine's
  update (``finish_weight_update``) exactly when a whole sync arrived, never on a partial one.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from weights.protocol import Transport, WeightsCall, WorkerStep
from weights.strategy import get_transport


def _transport(call: WeightsCall) -> Transport:
    return get_transport(call.key.kind)


class SendEnd:
    """A learner rank's end. `export_weights(bucket_mb, device=...)` yields buckets of (name, tensor);
    `device` returns the rank's device (read when a transport needs it: the learner is built late);
    `timeout_s` bounds every wait of a collective transport on its peers (learner.collective_timeout_s)."""

    def __init__(self, export_weights: Callable[..., Any], rank: int = 0, device: Callable[[], Any] | None = None,
                 timeout_s: float = 600.0):
        self.export_weights = export_weights
        self.rank = int(rank)
        self._device = device
        self.timeout_s = float(timeout_s)
        self.halves: dict = {}

    @property
    def device(self) -> Any:
        return self._device() if self._device is not None else None

    async def handle(self, call: WeightsCall) -> Any:
        transport = _transport(call)
        if call.step.blocking:
            return await asyncio.to_thread(transport.on_sender, self, call.step)
        return transport.on_sender(self, call.step)


class ReceiveEnd:
    """A generator's end. `load_weights(named, version)` copies tensors into the engine; `engine()`
    returns the engine now (a DeferredEngine builds its own on wake), whose `loads_in_workers` decides
    whether messages go to its workers as they came."""

    def __init__(self, load_weights: Callable[..., Any], engine: Callable[[], Any]):
        self.load_weights = load_weights
        self._engine = engine
        self.halves: dict = {}

    @property
    def engine(self) -> Any:
        return self._engine()

    def in_workers(self) -> bool:
        return bool(getattr(self.engine, "loads_in_workers", False))

    def receiver(self, transport: Transport) -> Any:
        """The transport's per-bucket receiver half, built once (again if the engine changed where it loads)."""
        in_workers = self.in_workers()
        slot = (transport.key, "receiver")
        held = self.halves.get(slot)
        if held is None or held[0] != in_workers:
            held = (in_workers, transport.make_receiver(self.load_weights, self.engine if in_workers else None))
            self.halves[slot] = held
        return held[1]

    async def handle(self, call: WeightsCall) -> tuple[Any, int | None]:
        return await _transport(call).on_receiver(self, call.step)


def on_worker(worker: Any, kind: str, step: WorkerStep | dict) -> Any:
    """Inside an engine's worker process (the vLLM worker extension's `arl_weights`): `step` as it
    crossed the engine's RPC (weights.protocol.to_worker), rebuilt typed by the transport."""
    return get_transport(kind).on_worker(worker, step)
