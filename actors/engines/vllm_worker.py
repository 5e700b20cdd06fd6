"""The code that runs INSIDE every vLLM worker process: weight updates that reach vLLM's workers.

vLLM mixes `WeightLoaderExtension` into each worker (``worker_extension_cls``); the engine calls
its ``arl_*`` methods through ``AsyncLLM.collective_rpc``, which msgpack-encodes the arguments for
the engine-core process. So only plain values cross that RPC here: bytes, ints, strings and dicts
of them. Never a tensor (msgpack turns it into a ``[dtype, shape, data]`` list, vLLM 0.26-0.32).

Invariants:
- CUDA IPC (colocated): the merged message (plan once, handles keyed by device uuid) arrives as
  pickled bytes; each worker opens ONLY the handle of its own GPU (``self.device``'s uuid), loads
  the views, synchronises, and drops them before returning, so the learner can free the bucket.
- Broadcast (disaggregated): each worker joins the learner's private NCCL group itself, as rank
  ``first_rank + self.rank`` (vLLM's rank of this worker in its engine: its tensor-parallel rank),
  and takes part in every broadcast; the learner is rank 0 (weights.broadcast).
- Plain bytes (where neither applies): the plan plus one raw buffer per dtype, rebuilt on the
  worker's device from dtype and shape.
- Every worker receives every tensor of a bucket under its Hugging Face name; vLLM's own
  ``model.load_weights`` takes this worker's tensor-parallel shard (and fuses q/k/v, gate/up).
- ``arl_finish`` hands the allocator's cached blocks (the loads' temporaries) back to the device
  and reports this worker's memory, so a sleep/reload/wake cycle does not keep them.
- This module imports neither vLLM nor Ray: a test's stand-in worker (a plain object with
  ``device``, ``rank`` and ``model_runner.model.load_weights``) runs the same code on CPU.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from weights.broadcast import BroadcastReceiver, Rendezvous
from weights.ipc import ipc_message_from_bytes, load_ipc_bucket
from weights.wire import WeightSyncError, payload_to_tensors


def run_coroutine(coro: Any) -> Any:
    """Runs `coro` to completion from synchronous code, also when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="arl-weight-sync", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def memory_stats(device: Any) -> dict[str, float]:
    """This process's view of its GPU (GiB): the allocator's allocated/reserved, the device's used."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
            "device_used_gib": (total - free) / 2**30}


class WeightLoaderExtension:
    """Mixed into every vLLM worker. `self.device`, `self.rank` and `self.model_runner` are the
    worker's own (vLLM's Worker); every method returns plain values."""

    def _arl_load(self, named: list) -> None:
        self.model_runner.model.load_weights(weights=named)

    def _arl_device(self) -> torch.device:
        return torch.device(getattr(self, "device", None) or "cpu")

    def arl_load_ipc(self, message: bytes, uuid: str | None = None) -> int:
        """One bucket of the CUDA IPC transport; returns how many tensors this worker loaded."""
        plan = load_ipc_bucket(ipc_message_from_bytes(message), self._arl_device(), self._arl_load, uuid=uuid)
        return len(plan.tensors)

    def arl_load_flat(self, plan: bytes, buffers: dict[str, bytes]) -> int:
        """One bucket as plain bytes (the plan gives each tensor's dtype, shape and offset)."""
        _, named = payload_to_tensors({"plan": plan, "buffers": buffers}, None, self._arl_device())
        self._arl_load(named)
        return len(named)

    def arl_join_group(self, rendezvous: dict, first_rank: int) -> int:
        """Joins the learner's private broadcast group; returns this worker's rank in it."""
        rdv = Rendezvous(**rendezvous)
        rank = int(first_rank) + int(getattr(self, "rank", 0) or 0)
        if not 1 <= rank < rdv.world_size:
            raise WeightSyncError(
                f"weight_sync nccl: this engine worker needs rank {rank} but the group's world_size is "
                f"{rdv.world_size} (give each generator weight_sync_ranks() consecutive ranks)")
        old = getattr(self, "_arl_receiver", None)
        if old is not None:
            old.close()
        receiver = BroadcastReceiver(lambda named, version: self._arl_load(named), device=self._arl_device())
        receiver.init(rdv, rank)
        self._arl_receiver = receiver
        return rank

    def arl_receive_group(self, version: int) -> int:
        """One sync over the group joined by arl_join_group (concurrently with the learner's send)."""
        receiver = getattr(self, "_arl_receiver", None)
        if receiver is None:
            raise WeightSyncError("weight_sync nccl: this engine worker joined no group (arl_join_group first)")
        return int(run_coroutine(receiver.receive_all(int(version))))

    def arl_finish(self) -> dict[str, float]:
        """After the last bucket: the loads' temporaries go back to the device; memory after."""
        device = self._arl_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return memory_stats(device)

    def arl_memory(self) -> dict[str, float]:
        return memory_stats(self._arl_device())
