"""What leaves a learner rank's weights: buckets for a weight sync and Hugging Face (or PEFT) exports.

Functions over actors/learner/engine.py's LearnerEngine (its `engine`, `cfg`, `lora`, `base_changed`, `dtype`,
`rank`, `model_path`), which calls them from its `export_weights` and `export_hf`.

Invariants:
- `export_buckets` yields HF-named tensors module by module; under ZeRO-3 it is collective (every rank must
  iterate it in lockstep) and never holds more than one module gathered at once. Tied weights appear once.
- With learner.lora only the adapter's tensors travel (under their PEFT names, actors/lora.py), the frozen
  base's only in the first export after a warm start trained it (actors/learner/lora_base.py); an export that
  found no tensor raises instead of syncing nothing (verl #7495).
- `export_hf` is called by every rank (the ZeRO-3 consolidation is collective); rank 0 writes, and copies the
  tokenizer files of the model directory beside the weights.
"""
from __future__ import annotations

import os
import shutil
from contextlib import nullcontext
from typing import Any, Iterator

import torch

from actors import lora


def gathered(engine: Any, params: list[torch.nn.Parameter]):
    """`params` whole for the block under ZeRO-3 (collective), as they are otherwise."""
    if engine.cfg.zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def export_buckets(engine: Any, bucket_mb: float = 512, device: str = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named tensors in buckets of about `bucket_mb`, gathered module by module under ZeRO-3.

    Tied weights appear once (under their first name, as named_parameters gives them). With
    learner.lora, the adapter's tensors under their PEFT names (actors/lora.py), and the frozen base's
    only in the first export after a warm start trained it (actors/learner/lora_base.py); an export that
    found no tensor raises instead of syncing nothing (verl #7495).
    """
    limit = max(1, int(bucket_mb * 2**20))
    model = engine.engine.module.model
    with_base = engine.lora and engine.base_changed  # the warm start trained the base: it travels once
    seen: set[int] = set()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = count = 0
    for mod_name, module in model.named_modules():
        own = [(wire_name(engine, f"{mod_name}.{n}" if mod_name else n, with_base), p)
               for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        own = [(n, p) for n, p in own if n is not None]
        if not own:
            continue
        with gathered(engine, [p for _, p in own]):
            for n, p in own:
                seen.add(id(p))
                t = p.detach().to(device=device, dtype=engine.dtype, copy=True)
                bucket.append((n, t))
                size += t.numel() * t.element_size()
                count += 1
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
    if count == 0:
        raise RuntimeError("export_weights found no tensor to send" + (
            " (learner.lora: the model holds no adapter parameter)" if engine.lora else ""))
    if with_base:
        engine.base_changed = False


def wire_name(engine: Any, name: str, with_base: bool = False) -> str | None:
    """The name a parameter travels under: its HF name; with LoRA its adapter name, and a base parameter's
    HF name only `with_base` (None: it stays)."""
    if not engine.lora:
        return name
    key = lora.adapter_key(name)
    return key if key is not None else (lora.base_hf_name(name) if with_base else None)


def export_hf(engine: Any, path: str) -> str:
    """save_pretrained of the current weights (what a server loads), plus the tokenizer files.
    Every rank calls it (the ZeRO-3 consolidation is collective); rank 0 writes."""
    os.makedirs(path, exist_ok=True)
    model = engine.engine.module.model
    if engine.lora:  # a PEFT adapter directory over the base model (actors/lora.py); every rank exports
        tensors = [t for bucket in export_buckets(engine, bucket_mb=1 << 20) for t in bucket]
        if engine.rank == 0:
            lora.save_adapter(path, tensors, engine.cfg.lora, os.path.abspath(engine.model_path)
                              if os.path.isdir(engine.model_path) else engine.model_path)
    elif engine.cfg.zero_stage == 3:
        state = engine.engine._zero3_consolidated_16bit_state_dict()  # rank 0's; None on the others
        if engine.rank == 0:
            prefix = "model."
            state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
            model.save_pretrained(path, state_dict=state)
    elif engine.rank == 0:
        model.save_pretrained(path)
    if engine.rank == 0 and os.path.isdir(engine.model_path):
        for name in os.listdir(engine.model_path):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or name == "generation_config.json":
                shutil.copy2(os.path.join(engine.model_path, name), os.path.join(path, name))
    return path
