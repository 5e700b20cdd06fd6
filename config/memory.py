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


LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(cfg: RunConfig, shape: ModelShape) -> int:
    """Parameters of learner.lora's adapter (0 when off): rank * (in + out) per targeted projection per layer."""
    lora = cfg.learner.lora
    if lora.rank <= 0:
        return 0
    h, q, kv, i = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    targets = LORA_ALL_LINEAR if list(lora.target_modules) == ["all-linear"] else lora.target_modules
    return shape.num_layers * sum(lora.rank * sum(dims[t]) for t in targets if t in dims)


def trainable_params(cfg: RunConfig, shape: ModelShape) -> int:
    """What has gradients and optimizer state: the adapter with learner.lora, else every parameter."""
    return lora_params(cfg, shape) if cfg.learner.lora.rank > 0 else shape.num_params


def learner_state_gib(cfg: RunConfig, n_params: int, world: int, trainable: int | None = None) -> dict[str, float]:
    """Weights, grads and optimizer states per rank under the ZeRO stage (GiB). `trainable` (default: all
    `n_params`) is what has gradients and optimizer state: with learner.lora the adapter alone, whose
    weights come on top of the frozen base's."""
    stage, b = cfg.learner.zero_stage, DTYPE_BYTES[cfg.learner.dtype]
    optimizer_bytes_per_param = 12 if cfg.learner.dtype == "bfloat16" else 8
    trainable = n_params if trainable is None else trainable
    held = n_params + (trainable if trainable != n_params else 0)
    weights = b * held / (world if stage >= 3 else 1)
    grads = b * trainable / (world if stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * trainable / (world if stage >= 1 else 1)
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


def learner_asleep_awake_gib(cfg: RunConfig, shape: ModelShape, world: int) -> tuple[dict[str, float], dict[str, float]]:
    """(asleep, awake) components of one learner rank (GiB): launch/plan.py's docstring has the formulas."""
    lr = cfg.learner
    states = learner_state_gib(cfg, shape.num_params, world, trainable_params(cfg, shape))
    asleep = {"learner weights": states["learner weights"]}
    if lr.zero_stage < 3:  # DeepSpeed keeps the gradient buffers of stages 0-2 allocated between steps
        asleep["learner grads"] = states["learner grads"]
    if not lr.offload_optimizer:
        asleep["learner optimizer"] = states["learner optimizer"]
    asleep["learner CUDA context"] = CUDA_CONTEXT_GIB
    awake = dict(states)
    if lr.zero_stage >= 3:
        awake["ZeRO-3 gather working set"] = zero3_gather_gib(cfg, shape)
    awake[_activations_label(cfg, shape)] = activation_gib(cfg, shape)
    awake["logits peak" + (" (liger chunks)" if lr.use_liger else " (full fp32)")] = logits_gib(cfg, shape)
    awake["learner CUDA context"] = CUDA_CONTEXT_GIB
    return asleep, awake


def vllm_awake_gib(cfg: RunConfig, shape: ModelShape) -> dict[str, float]:
    """One engine GPU with vLLM awake (GiB): its weight shard and KV cache fill its fraction
    (generator.gpu_memory_utilization x cluster.gpu_memory_gib); its CUDA context is outside it (vLLM
    measures its fraction from a snapshot taken after the context exists; the H200 showed 0.35-0.5 GiB)."""
    gen, mem = cfg.generator, cfg.cluster.gpu_memory_gib
    shard = DTYPE_BYTES[cfg.model.dtype] * shape.num_params / gen.tensor_parallel_size / GIB
    kv = gen.gpu_memory_utilization * mem - shard
    out = {"vLLM weights shard": shard}
    if kv >= 0:
        out["vLLM KV cache"] = kv
    out["vLLM CUDA context"] = CUDA_CONTEXT_GIB
    return out


def shared_async_check(cfg: RunConfig) -> str:
    """'' when async on shared GPUs fits one GPU (or does not apply, or the model's shape is unknown
    here), else the one-line reason naming the fields (`shared_async_budget`)."""
    from config.placement import make_placement

    placement = make_placement(cfg)
    if not placement.shared or placement.errors:
        return ""
    try:
        shape = model_shape(cfg)
    except ConfigError:
        return ""
    _, awake = learner_asleep_awake_gib(cfg, shape, max(1, placement.learner_world_size))
    bucket = 2 * cfg.coordinator.weight_bucket_mb / 1024
    return shared_async_budget(cfg, sum(vllm_awake_gib(cfg, shape).values()), sum(awake.values()) + bucket)


def learner_build_gib(cfg: RunConfig, n_params: int, world: int, trainable: int | None = None) -> dict[str, float]:
    """What a learner rank holds at the end of its build, before anything sleeps (GiB).

    DeepSpeed makes the optimizer's state at build: its bf16 (and ZeRO) optimizers step Adam once on zero
    gradients (FP16_UnfusedOptimizer / ZeRO's `initialize_optimizer_states`), so the fp32 masters and both
    moments are on the device at once, with the zero gradients (the bf16 ones and their fp32 copies) and
    the step's foreach temporaries freed into the allocator's cache, not to the device: + 8 bytes a
    parameter (ZeRO-1+: of this rank's partition). A plain fp32 AdamW at ZeRO-0 makes its state lazily (at
    the first step): weights alone then. Measured on the H200 (gpu1_0p6b, 354M parameters): 9.07 GiB
    device-wide after the build, against 8.4 planned here (24 bytes a parameter + the context)."""
    states = learner_state_gib(cfg, n_params, world, trainable)
    if cfg.learner.dtype != "bfloat16" and cfg.learner.zero_stage == 0:
        return {"learner weights": states["learner weights"], "learner CUDA context": CUDA_CONTEXT_GIB}
    part = world if cfg.learner.zero_stage >= 1 else 1
    trainable = n_params if trainable is None else trainable
    return {**states, "optimizer build step (cached)": 8 * trainable / part / GIB,
            "learner CUDA context": CUDA_CONTEXT_GIB}


def startup_and_checkpoint_phases(cfg: RunConfig, build: dict[str, float], generation: dict[str, float],
                                  optimizer_gib: float) -> dict[str, dict[str, float]]:
    """Colocated engine+learner GPU: the phases besides the step's (launch/create.py, launch/place.py,
    the coordinator).

    learner build : the launcher builds the learner and puts it to sleep before any engine starts on its GPU
                    (`learner_build_gib`, alone on the device); the engines then start beside a sleeping
                    learner (the generation phase), and the warm start runs with the engines asleep (a
                    training phase), so neither adds a peak.
    checkpoint    : a mid-run checkpoint (coordinator.checkpoint_every < steps) wakes the learner (its
                    offloaded optimizer back on the device) while the engines generate the next step; the
                    final checkpoint runs with the engines asleep. Only with learner.offload_optimizer."""
    out: dict[str, dict[str, float]] = {"learner build": dict(build)}
    co = cfg.coordinator
    if cfg.learner.offload_optimizer and 0 < co.checkpoint_every < co.steps:
        out["checkpoint"] = {**generation, "learner optimizer (saving)": optimizer_gib}
    return out


def shared_async_phases(build: dict[str, float], vllm_awake: dict[str, float], awake: dict[str, float],
                        bucket_gib: float) -> dict[str, dict[str, float]]:
    """Async on shared GPUs (config.placement's `shared`): nothing sleeps. The learner is built and put to
    sleep before the engine starts (learner build); then the engine holds its whole fraction and the learner
    its training footprint for the whole run (the allocator keeps the step's activations cached between
    steps), the warm start included; a weight sync adds two buckets beside both."""
    return {"learner build": dict(build),
            "generation+training": {**vllm_awake, **awake},
            "weight_sync": {**vllm_awake, **awake, "weight buckets (x2)": bucket_gib}}


def shared_async_budget(cfg: RunConfig, vllm_gib: float, learner_gib: float) -> str:
    """'' when vLLM's resident fraction and the awake learner fit one GPU together, else the one-line reason
    naming the fields (async on shared GPUs; config.validate.check_inputs raises it as a ConfigError)."""
    mem = cfg.cluster.gpu_memory_gib
    if vllm_gib + learner_gib <= mem + 1e-9:
        return ""
    util = cfg.generator.gpu_memory_utilization
    return (f"config keys 'generator.gpu_memory_utilization', 'assembler.micro_batch_tokens': async on shared GPUs "
            f"keeps vLLM ({util:g} x {mem:g} GiB + its context = {vllm_gib:.2f} GiB) and the awake learner "
            f"({learner_gib:.2f} GiB: states, activations of {cfg.assembler.micro_batch_tokens} tokens, weight "
            f"buckets) resident together: {vllm_gib + learner_gib:.2f} GiB > cluster.gpu_memory_gib={mem:g}; the "
            f"learner's budget is {mem - vllm_gib:.2f} GiB: lower generator.gpu_memory_utilization or "
            f"assembler.micro_batch_tokens")
