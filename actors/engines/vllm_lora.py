"""The vLLM engine's LoRA adapter: the learner's, swapped in whole at every weight update, or an export's.

vLLM loads a LoRA adapter from a PEFT directory named by a `LoRARequest(lora_name, lora_int_id, lora_path)`
(AsyncLLM.add_lora / remove_lora; every generate() names the request it runs under). So adapter-only weight
sync ends here: the transport hands the adapter's tensors to the engine's `load_weights` in the generator's
own process (coordinator.weight_sync is object_store under learner.lora), they are staged, and
`finish_weight_update(version)` writes them as a directory and swaps the request.

Invariants:
- Each version gets a new adapter id (1, 2, ...), a new directory and a new request; the previous adapter is
  removed from vLLM and its directory deleted only after the new one was added, so a failed add leaves the
  engine on the old adapter and the old version.
- An update that staged no adapter tensor, or a set of names other than the previous version's, fails `switch`
  (one line) before vLLM's adapter is touched: a sync that moved nothing never passes for a new policy (verl
  #7495). Tensors under Hugging Face names (a LoRA warm start's trained base, in the first sync after it) go
  to the workers' model as a full sync's do.
- An export's adapter (`export`) is fixed: one request (id 1) for the engine's life; weight updates are refused.
- Imports no vLLM: the engine hands `switch` vLLM's LoRARequest class (tests hand a stand-in).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from actors import lora
from config import GeneratorConfig


class VLLMAdapter:
    def __init__(self, rank: int, base_model: str, lora_cfg: Any = None, export_dir: str = "",
                 workdir: str | None = None):
        self.rank, self.base_model, self.lora_cfg = int(rank), base_model, lora_cfg
        self.export = bool(export_dir)
        self._ids = itertools.count(1)
        self._staged: list[tuple[str, Any]] = []
        self._base_loaded = False
        self._names: set[str] | None = None  # the previous version's tensor names
        self.request: Any = None
        self._export_dir = export_dir
        self._workdir = workdir

    @classmethod
    def for_engine(cls, generator_cfg: GeneratorConfig, model_path: str) -> "VLLMAdapter | None":
        """The adapter an engine over `model_path` serves: an export's, the learner's (generator.lora), or None."""
        if lora.is_adapter_dir(model_path):
            config, _ = lora.read_adapter(model_path)
            return cls(int(config["r"]), lora.base_model_of(model_path), export_dir=str(model_path))
        lora_cfg = generator_cfg.lora
        if lora.enabled(lora_cfg):
            return cls(lora_cfg.rank, model_path, lora_cfg)
        return None

    def stage(self, named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Stages the adapter's tensors; returns the others (a LoRA warm start's base, under Hugging Face names:
        the engine loads them into its workers' model, once)."""
        if self.export:
            raise RuntimeError("this engine serves a LoRA export: its adapter is fixed, weight updates are refused")
        base = []
        for name, t in named_tensors:
            if name.startswith(lora.PEFT_PREFIX):
                lora.param_name(name)  # KeyError naming a malformed adapter name
                self._staged.append((name, t.detach().to("cpu", copy=True)))
            else:
                base.append((name, t))
        self._base_loaded = self._base_loaded or bool(base)
        return base

    def take_base_loaded(self) -> bool:
        """Whether this update loaded base tensors (then reset)."""
        loaded, self._base_loaded = self._base_loaded, False
        return loaded

    def first_request(self, request_cls: Any) -> Any:
        """An export's request (made once, on the first generate)."""
        if self.export and self.request is None:
            self.request = request_cls(lora_name="export", lora_int_id=next(self._ids), lora_path=self._export_dir)
        return self.request

    async def switch(self, llm: Any, version: int, request_cls: Any) -> Any:
        """The staged adapter becomes version `version`'s request; the old one is removed after."""
        staged, self._staged = self._staged, []
        names = {n for n, _ in staged}
        if not staged:
            raise RuntimeError(f"weight update v{version} brought no LoRA adapter tensor: the engine keeps "
                               f"v{version - 1}'s adapter")
        if len(names) != len(staged):
            raise RuntimeError(f"weight update v{version} brought an adapter tensor twice")
        if self._names is not None and names != self._names:
            diff = sorted(names ^ self._names)
            raise RuntimeError(f"weight update v{version} brought {len(names)} adapter tensors, the adapter has "
                               f"{len(self._names)} (e.g. {diff[0]} differs)")
        if self._workdir is None:
            self._workdir = _default_workdir()
        root = Path(self._workdir)
        new_id = next(self._ids)
        path = lora.save_adapter(root / f"v{version}-id{new_id}", staged, self.lora_cfg, self.base_model)
        request = request_cls(lora_name=f"arl-v{version}", lora_int_id=new_id, lora_path=str(path))
        try:
            added = await llm.add_lora(lora_request=request)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if added is False:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM refused LoRA adapter v{version} ({path})")
        old, self.request, self._names = self.request, request, names
        if old is not None:
            await llm.remove_lora(lora_id=old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return request


def _default_workdir() -> str:
    """Where adapter directories live between syncs: shared memory where there is one (no disk write)."""
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="arl-lora-", dir=parent)
