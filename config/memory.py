"""Memory arithmetic of the --dry-run plan and the model shapes it reads: pure functions, no Ray, no torch.

The formulas are documented once, in launch/plan.py's docstring (which renders them per GPU and phase).
Invariants: every result is in GiB (2**30 bytes) unless its name says bytes; a shape the table does not
know and that no local config.json gives is a ConfigError naming `model.path`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from config.schema import ConfigError, RunConfig

GIB = float(1 << 30)
CUDA_CONTEXT_GIB = 0.5
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# ---------------------------------------------------------------------------------------------
# Model shapes


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attention = h * self.num_heads * hd + 2 * h * self.num_kv_heads * hd + self.num_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + 2 * hd
        return attention + mlp + norms

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self.num_layers * self.layer_params + self.hidden_size


def _qwen3(name, hidden, layers, heads, kv_heads, intermediate, tied) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, 128, intermediate, 151_936, tied)


QWEN3_SHAPES: dict[str, ModelShape] = {s.name.lower(): s for s in [
    _qwen3("Qwen/Qwen3-0.6B", 1024, 28, 16, 8, 3072, True),
    _qwen3("Qwen/Qwen3-1.7B", 2048, 28, 16, 8, 6144, True),
    _qwen3("Qwen/Qwen3-4B", 2560, 36, 32, 8, 9728, True),
    _qwen3("Qwen/Qwen3-8B", 4096, 36, 32, 8, 12288, False),
    _qwen3("Qwen/Qwen3-14B", 5120, 40, 40, 8, 17408, False),
    _qwen3("Qwen/Qwen3-32B", 5120, 64, 64, 8, 25600, False),
]}


def model_shape(cfg: RunConfig) -> ModelShape:
    """The model's shape: the tiny_* fields, a local config.json, or the built-in Qwen3 table."""
    m = cfg.model
    if m.source == "tiny":
        return ModelShape("tiny", m.tiny_hidden_size, m.tiny_layers, m.tiny_heads, m.tiny_kv_heads,
                          m.tiny_hidden_size // m.tiny_heads, m.tiny_intermediate_size, m.tiny_vocab_size, True)
    path = Path(m.path) if m.path else None
    if path is not None and path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"config key 'model.path': {path} has no config.json to read the model shape from")
        try:
            c = json.loads(config_file.read_text())
            heads = int(c["num_attention_heads"])
            return ModelShape(str(path), int(c["hidden_size"]), int(c["num_hidden_layers"]), heads,
                              int(c.get("num_key_value_heads") or heads),
                              int(c.get("head_dim") or c["hidden_size"] // heads),
                              int(c["intermediate_size"]), int(c["vocab_size"]),
                              bool(c.get("tie_word_embeddings", False)))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"config key 'model.path': {config_file} lacks a usable field ({e})") from None
    shape = QWEN3_SHAPES.get(m.path.lower())
    if shape is None:
        known = ", ".join(s.name for s in QWEN3_SHAPES.values())
        raise ConfigError(f"config key 'model.path': {m.path!r} is neither a local directory with config.json "
                          f"nor a known hub id ({known})")
    return shape



# ---------------------------------------------------------------------------------------------
# Arithmetic


def learner_state_gib(cfg: RunConfig, n_params: int, world: int) -> dict[str, float]:
    """Weights, grads and optimizer states per rank under the ZeRO stage (GiB)."""
    stage, b = cfg.learner.zero_stage, DTYPE_BYTES[cfg.learner.dtype]
    optimizer_bytes_per_param = 12 if cfg.learner.dtype == "bfloat16" else 8
    weights = b * n_params / (world if stage >= 3 else 1)
    grads = b * n_params / (world if stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * n_params / (world if stage >= 1 else 1)
    return {"learner weights": weights / GIB, "learner grads": grads / GIB, "learner optimizer": optimizer / GIB}


def layer_activation_bytes(shape: ModelShape, tokens: int, bytes_per: int) -> int:
    h, hd = shape.hidden_size, shape.head_dim
    per_token = 5 * h + 4 * (shape.num_heads + shape.num_kv_heads) * hd + 4 * shape.intermediate_size
    return tokens * per_token * bytes_per


def activation_gib(cfg: RunConfig, shape: ModelShape) -> float:
    tokens, b = cfg.assembler.micro_batch_tokens, DTYPE_BYTES[cfg.learner.dtype]
    one_layer = layer_activation_bytes(shape, tokens, b)
    if not cfg.learner.gradient_checkpointing:
        return shape.num_layers * one_layer / GIB
    n = checkpointed_layers(cfg, shape)
    # a checkpointed layer keeps its input; the others keep everything; backward recomputes one at a time
    return (shape.hidden_size * tokens * n * b + (shape.num_layers - n) * one_layer + one_layer) / GIB


def _activations_label(cfg: RunConfig, shape: ModelShape) -> str:
    if not cfg.learner.gradient_checkpointing:
        return "activations (no checkpointing)"
    n = checkpointed_layers(cfg, shape)
    return "activations (checkpointed)" if n == shape.num_layers else f"activations (ckpt {n}/{shape.num_layers})"


def _checkpointing_note(cfg: RunConfig, shape: ModelShape) -> str:
    if not cfg.learner.gradient_checkpointing:
        return "off"
    n = checkpointed_layers(cfg, shape)
    return "on" if n == shape.num_layers else f"on for {n} of {shape.num_layers} layers"


def checkpointed_layers(cfg: RunConfig, shape: ModelShape) -> int:
    n = cfg.learner.checkpoint_layers
    if n > shape.num_layers:
        raise ConfigError(f"config key 'learner.checkpoint_layers': {n} exceeds the model's {shape.num_layers} decoder layers")
    return shape.num_layers if n < 0 else n


def logits_gib(cfg: RunConfig, shape: ModelShape) -> float:
    tokens, vocab = cfg.assembler.micro_batch_tokens, shape.vocab_size
    if not cfg.learner.use_liger:
        return tokens * vocab * 4 / GIB
    chunks = math.ceil(vocab / shape.hidden_size)
    chunk_tokens = min(tokens, 1 << max(0, math.ceil(math.log2(math.ceil(tokens / chunks)))))
    return 2 * chunk_tokens * vocab * 4 / GIB


def zero3_gather_gib(cfg: RunConfig, shape: ModelShape) -> float:
    largest_module = max(shape.layer_params, shape.embedding_params)
    return 3 * largest_module * DTYPE_BYTES[cfg.learner.dtype] / GIB


def kv_bytes_per_token(shape: ModelShape, tp: int, bytes_per: int) -> int:
    kv_heads_per_gpu = max(1, math.ceil(shape.num_kv_heads / tp))
    return 2 * shape.num_layers * kv_heads_per_gpu * shape.head_dim * bytes_per


def fp32_masters_gib(cfg: RunConfig, n_params: int, world: int) -> float:
    """The fp32 master weights of bf16 mixed precision (part of the optimizer's 12 bytes per parameter),
    which DeepSpeed allocates when the learner is built; ZeRO-1+ divides them by the world. 0 in fp32."""
    if cfg.learner.dtype != "bfloat16":
        return 0.0
    return 4 * n_params / (world if cfg.learner.zero_stage >= 1 else 1) / GIB


def startup_and_checkpoint_phases(cfg: RunConfig, generation: dict[str, float], optimizer_gib: float,
                                  masters_gib: float) -> dict[str, dict[str, float]]:
    """Colocated engine+learner GPU: the phases besides the step's (launch/place.py, the coordinator).

    start-up   : the engine starts (its whole fraction) while the learner is built: the generation phase
                 plus the learner's fp32 masters, which stay on the device until its first sleep (with
                 learner.offload_optimizer; without, they are in the generation phase already). The warm
                 start then runs with the engines asleep (a training phase) and the learner sleeps before
                 the first generation, so neither adds a peak.
    checkpoint : a mid-run checkpoint (coordinator.checkpoint_every < steps) wakes the learner (its
                 offloaded optimizer back on the device) while the engines generate the next step; the
                 final checkpoint runs with the engines asleep. Only with learner.offload_optimizer.
    Only the phases that differ from generation are returned."""
    out: dict[str, dict[str, float]] = {}
    if cfg.learner.offload_optimizer and masters_gib > 0:
        out["start-up"] = {**generation, "learner fp32 masters (till sleep)": masters_gib}
    co = cfg.coordinator
    if cfg.learner.offload_optimizer and 0 < co.checkpoint_every < co.steps:
        out["checkpoint"] = {**generation, "learner optimizer (saving)": optimizer_gib}
    return out

