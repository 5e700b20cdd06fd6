"""The transformers engine's weights: sleep, wake, bucketed loads, the version switch.

Invariants (see actors/engines/hf.py for the whole engine):
- Sleep refuses while any request is queued, decoding or parked by interrupt().
- Level 1 keeps a CPU copy of every weight; level 2 keeps none, so after wake(["weights"]) every
  tensor is owed by load_weights and finish_weight_update refuses until all arrived.
- Parameters keep their identity (only `.data` is swapped), so tied embeddings stay tied.
- Weights change only under the model lock, i.e. between decode steps.
- LoRA (generator.lora, or a LoRA export): the model holds the learner's adapter; each update must load every
  adapter tensor (by its PEFT name) before finish_weight_update takes the new version, so a sync that moved
  none of them fails instead of leaving the old policy in place under a new version number.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from actors.engines.base import EngineAsleep, check_wake_tags


class WeightsMixin:
    def _busy(self) -> int:
        return sum(1 for r in self._active + self._pending + self._parked if not r.future.done())

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._busy():
            raise RuntimeError(f"sleep({level}) with {self._busy()} requests in flight: pause the generator first")
        async with self._model_lock():
            if not self._weights_present:
                self._sleep_level = max(self._sleep_level, level)
                if level == 2:
                    self._offloaded.clear()
                return
            for name, p in self._params.items():
                if level == 1:
                    self._offloaded[name] = p.data if p.device.type == "cpu" else p.data.to("cpu")
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_present = False
            self._sleep_level = level
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    async def wake(self, tags: list[str] | None = None) -> None:
        tags = check_wake_tags(tags)
        if "weights" not in tags or self._weights_present:
            return  # "kv_cache": allocated per batch here, nothing to restore
        async with self._model_lock():
            for name, p in self._params.items():
                if name in self._offloaded:
                    p.data = self._offloaded.pop(name).to(self.device)
                else:
                    p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=self.device)
                    self._unloaded.add(name)
            self._weights_present = True
            self._sleep_level = 0

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        async with self._model_lock():
            if not self._weights_present:
                raise EngineAsleep("load_weights on a sleeping engine: call wake(['weights']) first")
            for name, tensor in named_tensors:
                canonical = self._aliases.get(name)
                if canonical is None:
                    raise KeyError(f"load_weights: {name!r} is not a parameter of this model "
                                   f"(e.g. {next(iter(self._params))!r})")
                param = self._params[canonical]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}")
                with torch.no_grad():
                    param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))
                self._unloaded.discard(canonical)
                if name in self._adapter:
                    self._adapter_loaded.add(name)

    async def finish_weight_update(self, version: int) -> None:
        if self._unloaded:
            raise RuntimeError(f"finish_weight_update({version}): {len(self._unloaded)} tensors were never loaded "
                               f"since the level-2 wake (e.g. {sorted(self._unloaded)[0]})")
        missing = sorted(set(self._adapter) - self._adapter_loaded)
        self._adapter_loaded = set()
        if missing:  # a sync that moved no (or part of the) adapter must not pass for a new policy (verl #7495)
            raise RuntimeError(f"finish_weight_update({version}): the update brought {len(self._adapter) - len(missing)} "
                               f"of the adapter's {len(self._adapter)} tensors (e.g. {missing[0]} is missing)")
        self.version = int(version)

