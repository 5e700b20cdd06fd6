"""LoRA adapters (peft) on a transformers causal LM: injected, named, saved, read back and merged.

The learner and the transformers engine wrap their model in the same adapter (`inject`), the learner's
weight sync sends the adapter's tensors alone under their PEFT names, and an export of a LoRA run is a
PEFT adapter directory (adapter_config.json + adapter_model.safetensors + the tokenizer files) that
transformers, peft and vLLM (LoRARequest) load over the base model it names.

Invariants:
- `inject` changes the model in place (peft's `inject_adapter_in_model`): every targeted Linear keeps its
  weight as a frozen `base_layer` and gains lora_A (random) and lora_B (zeros), so the output is the base's
  until B moves; only adapter parameters have requires_grad. Targets that match no module are one ValueError
  naming `learner.lora.target_modules`.
- A parameter's wire name (`adapter_key`) is PEFT's saved name: "base_model.model." + its module path, the
  adapter's own name (".default") removed, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight;
  `param_name` is its inverse. A base parameter has no wire name (None): it never travels.
- `save_adapter` / `read_adapter` round-trip bit for bit; `load_adapter_model` gives the learner's model
  exactly (same base, same adapter, same scale alpha / rank).
- Imports peft and torch only when called (config and the coordinator never import them).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from config import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"
_LORA_SEGMENT = re.compile(r"\.(lora_[A-Za-z_]+)\." + ADAPTER_NAME + r"(\.|$)")
_WIRE_SEGMENT = re.compile(r"\.(lora_[A-Za-z_]+)(\.|$)")


def enabled(lora_cfg: LoraConfig) -> bool:
    return lora_cfg.rank > 0


def peft_config(lora_cfg: LoraConfig, base_model: str = "") -> Any:
    """peft's LoraConfig of ours."""
    import peft

    targets = list(lora_cfg.target_modules)
    return peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model or None)


def inject(model: Any, lora_cfg: LoraConfig) -> Any:
    """Wraps `model`'s targeted Linear modules in LoRA layers, in place; freezes everything else."""
    return inject_config(model, peft_config(lora_cfg), field="learner.lora.target_modules")


def inject_config(model: Any, config: Any, field: str = "target_modules") -> Any:
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise ValueError(f"{field}: {str(e).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(adapter_key(name) is not None)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{field}: no LoRA parameter was created")
    return model


def adapter_key(name: str) -> str | None:
    """The wire (PEFT saved) name of parameter `name`, or None for a base parameter."""
    if not _LORA_SEGMENT.search(name):
        return None
    return PEFT_PREFIX + _LORA_SEGMENT.sub(r".\1\2", name)


def base_hf_name(name: str) -> str:
    """A base parameter's Hugging Face name in a model `inject` wrapped (a targeted Linear's `.base_layer` dropped)."""
    return name.replace(".base_layer.", ".")


def param_name(key: str) -> str:
    """The parameter a wire name belongs to in a model `inject` wrapped (inverse of `adapter_key`)."""
    if not key.startswith(PEFT_PREFIX) or not _WIRE_SEGMENT.search(key):
        raise KeyError(f"{key!r} is not a LoRA adapter tensor name (expected {PEFT_PREFIX}<module>.lora_A.weight)")
    return _WIRE_SEGMENT.sub(r".\1." + ADAPTER_NAME + r"\2", key[len(PEFT_PREFIX):])


def adapter_params(model: Any) -> dict[str, Any]:
    """wire name -> parameter, for every adapter parameter of `model` (in named_parameters order)."""
    out = {}
    for name, p in model.named_parameters():
        key = adapter_key(name)
        if key is not None:
            out[key] = p
    return out


def adapter_nbytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in adapter_params(model).values())


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def save_adapter(path: str | Path, tensors: Iterable[tuple[str, Any]], lora_cfg: LoraConfig, base_model: str) -> Path:
    """A PEFT adapter directory: adapter_config.json (naming `base_model`) and adapter_model.safetensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().to("cpu").contiguous() for k, t in tensors}
    if not state:
        raise ValueError(f"save_adapter {path}: no adapter tensors to save")
    save_file(state, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    peft_config(lora_cfg, base_model).save_pretrained(str(path))
    return path


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json as a dict, wire name -> tensor) of an adapter directory (ValueError naming it)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / ADAPTER_CONFIG}: not a readable adapter config ({str(e).splitlines()[0]})") from None
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"adapter directory {path} has no {ADAPTER_WEIGHTS}")
    return config, load_file(str(path / ADAPTER_WEIGHTS))


def config_from_dict(config: Mapping[str, Any]) -> Any:
    """peft's LoraConfig from an adapter_config.json dict."""
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__)
    return LoraConfig(**{k: v for k, v in config.items() if k in known})


def load_tensors(model: Any, tensors: Mapping[str, Any]) -> int:
    """Copies adapter tensors (wire names) into an injected model; every adapter parameter must be given."""
    import torch

    params = adapter_params(model)
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"adapter tensors do not fit the model: missing {missing[:3]}, unknown {extra[:3]}")
    with torch.no_grad():
        for key, p in params.items():
            t = tensors[key]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"adapter tensor {key} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))
    return len(params)


def base_model_of(path: str | Path) -> str:
    config, _ = read_adapter(path)
    base = str(config.get("base_model_name_or_path") or "")
    if not base:
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG} names no base_model_name_or_path")
    return base


def load_adapter_model(path: str | Path, **from_pretrained: Any) -> Any:
    """The base model an adapter directory names, with the adapter injected and loaded (eval, serve)."""
    from transformers import AutoModelForCausalLM

    config, tensors = read_adapter(path)
    base = base_model_of(path)
    model = AutoModelForCausalLM.from_pretrained(base, **from_pretrained)
    inject_config(model, config_from_dict(config), field=f"{Path(path) / ADAPTER_CONFIG} target_modules")
    load_tensors(model, tensors)
    return model


def merge_export(src: str | Path, dst: str | Path) -> Path:
    """A LoRA export merged into its base: a plain Hugging Face model directory (config.json, weights, the
    export's tokenizer and settings files) that any server loads without LoRA support."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    base = AutoModelForCausalLM.from_pretrained(base_model_of(src))
    merged = PeftModel.from_pretrained(base, str(src)).merge_and_unload()
    dst.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(dst))
    for f in src.iterdir():
        if f.is_file() and f.name not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
    return dst
