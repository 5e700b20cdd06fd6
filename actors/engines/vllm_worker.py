"""The code that runs INSIDE every vLLM worker process: the one door weight updates come in by.

vLLM mixes `WeightLoaderExtension` into each worker (``worker_extension_cls``); the engine calls its
``arl_*`` methods through ``AsyncLLM.collective_rpc``, which msgpack-encodes the arguments for the
engine-core process. So only plain values cross that RPC here: bytes, ints, strings and dicts of
them. Never a tensor (msgpack turns it into a ``[dtype, shape, data]`` list, vLLM 0.26-0.32).

Invariants:
- ``arl_weights(kind, step)`` hands one step of a weight-sync transport (a ``weights.WorkerStep`` as
  plain builtins) to that transport (weights.endpoint.on_worker); what the step does (open this GPU's
  CUDA IPC handles, join and take part in a broadcast group, rebuild plain bytes on this device) is
  the transport's, in weights/.
  This class knows no transport.
- What a transport may use here: ``arl_device()`` (this worker's device), ``arl_load(named)`` (vLLM's
  own ``model.load_weights``, which takes this worker's tensor-parallel shard and fuses q/k/v and
  gate/up, under each tensor's Hugging Face name), ``rank`` (this worker's rank in its engine) and
  ``arl_uuid`` (this GPU's uuid; None: read from the device).
- Under LoRA (enable_lora) vLLM wraps each LoRA-capable layer in a module that holds the original as
  ``base_layer`` (its parameters renamed ``<layer>.base_layer.weight``), which ``load_weights`` cannot
  name. ``arl_load`` puts the originals back in their parents for the load and the wrappers back after,
  even when the load fails: the same parameter objects are written, so the adapter's layers see the
  new base (a LoRA warm start's base, in the first sync).
- ``arl_finish`` hands the allocator's cached blocks (the loads' temporaries) back to the device
  and reports this worker's memory, so a sleep/reload/wake cycle does not keep them.
- This module imports neither vLLM nor Ray: a test's stand-in worker (a plain object with
  ``device``, ``rank`` and ``model_runner.model.load_weights``) runs the same code on CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from actors.device_memory import memory_stats
from weights.endpoint import on_worker


class WeightLoaderExtension:
    """Mixed into every vLLM worker. `self.device`, `self.rank` and `self.model_runner` are the
    worker's own (vLLM's Worker); every method returns plain values."""

    arl_uuid: str | None = None  # this GPU's uuid; None: read from self.device (CPU tests set one)

    def arl_load(self, named: list) -> None:
        model = self.model_runner.model
        with lora_unwrapped(model):
            model.load_weights(weights=named)

    def arl_device(self) -> torch.device:
        return torch.device(getattr(self, "device", None) or "cpu")

    def arl_weights(self, kind: str, step: dict) -> Any:
        """One step of weight-sync transport `kind` in this worker (weights/)."""
        return on_worker(self, kind, step)

    def arl_finish(self) -> dict[str, float]:
        """After the last bucket: the loads' temporaries go back to the device; memory after."""
        device = self.arl_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return memory_stats(device)

    def arl_memory(self, reset_peak: bool = False) -> dict[str, float]:
        return memory_stats(self.arl_device(), reset_peak)


def _is_lora_wrapper(module: torch.nn.Module) -> bool:
    """vLLM's LoRA layer (BaseLayerWithLoRA): the original layer as `base_layer`, LoRA slots set by `set_lora`."""
    return isinstance(getattr(module, "base_layer", None), torch.nn.Module) and callable(getattr(module, "set_lora", None))


@contextmanager
def lora_unwrapped(model: torch.nn.Module) -> Iterator[int]:
    """`model` with every vLLM LoRA wrapper replaced by its `base_layer` in its parent, restored on exit;
    yields how many were replaced (0 without LoRA, or for a test's plain stand-in model: nothing changes)."""
    swapped = []
    modules = list(model.named_modules()) if isinstance(model, torch.nn.Module) else []
    for name, module in modules:
        if name and _is_lora_wrapper(module):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swapped.append((parent, attr, module))
    for parent, attr, module in swapped:
        setattr(parent, attr, module.base_layer)
    try:
        yield len(swapped)
    finally:
        for parent, attr, module in swapped:
            setattr(parent, attr, module)
