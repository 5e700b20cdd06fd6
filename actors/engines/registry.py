"""Which engine class a generator config names: the one place that knows every engine.

Invariants:
- The interface (actors/engines/base.py) imports no concrete engine and no engine imports the
  registry: the arrows run registry -> engines -> base.
- An unknown `generator.engine` is one ValueError line naming the key.
"""
from __future__ import annotations

from actors.engines.base import Engine
from config import GeneratorConfig, ModelConfig


def make_engine(generator_cfg: GeneratorConfig, model_cfg: ModelConfig, model_path: str) -> Engine:
    """The engine named by generator_cfg.engine ("vllm" | "transformers" | "simulated")."""
    kind = generator_cfg.engine
    if kind == "transformers":
        from actors.engines.hf import TransformersEngine

        return TransformersEngine(generator_cfg, model_cfg, model_path)
    if kind == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        return VLLMEngine(generator_cfg, model_cfg, model_path)
    if kind == "simulated":
        from actors.engines.simulated import SimulatedEngine

        return SimulatedEngine(generator_cfg, model_cfg, model_path)
    raise ValueError(f"generator.engine must be 'vllm', 'transformers' or 'simulated', got {kind!r}")
