"""The --dry-run plan: which actor runs where, and what each GPU holds in each phase. Pure arithmetic.

`make_plan(cfg) -> Plan`; `Plan.render()` is the table `python -m launch.cluster RECIPE --dry-run`
prints, `Plan.to_dict()` the same as builtins, `Plan.fits` the verdict (the CLI's exit code).

Placement
    GPUs are cluster.num_nodes x cluster.gpus_per_node. Generator engines (generator.num_engines,
    each generator.tensor_parallel_size GPUs) are packed first-fit onto nodes in order, so a TP group
    never crosses a node. colocated: one learner rank on every GPU (world size = all GPUs), engines on
    the first num_engines x TP of them. async: the engines' GPUs are theirs alone and the learner gets
    every remaining GPU (world size = total - engine GPUs); too few GPUs is a failure. The coordinator,
    the scorers and the assembler take CPUs of node 0. With no GPUs (tiny) the plan is CPU only: every
    actor's Ray CPU request, summed against cluster.num_cpus (0: this machine's CPUs).

Memory, per GPU, in GiB (2**30 bytes). N = parameters, W = learner world size, T = assembler.micro_batch_tokens,
h = hidden, L = layers, I = intermediate, V = vocab, hd = head_dim, nh/nkv = attention/KV heads, b = bytes of dtype.
    N                = V*h (embedding) [+ V*h lm_head if untied] + L*(h*nh*hd + 2*h*nkv*hd + nh*hd*h + 3*h*I
                       + 2*h + 2*hd) + h                        (Qwen3: no biases; q_norm/k_norm of size hd)
    learner states   = weights b_l*N + grads b_l*N + optimizer k*N, with b_l = bytes of learner.dtype and
                       k = 12 for bf16 mixed precision (fp32 master + 2 fp32 moments), 8 for fp32 (2 moments);
                       ZeRO-1 divides the optimizer by W, ZeRO-2 also the grads, ZeRO-3 also the weights.
    ZeRO-3 gather    = 3 * max(layer params, V*h) * b_l: the running module's full weights, one prefetched
                       module, and the running module's full gradient before its reduce-scatter.
    activations      = with gradient checkpointing: h*T*L*b_l (one checkpointed input per layer) + one layer's
                       full activations; without: L * one layer's full activations.
    one layer's full = T * (5h + 4*(nh+nkv)*hd + 4I) * b_l: residual, norms, o_proj out (5h); q/k each as
                       projection, qk-norm and rope output, v, attention output (4*(nh+nkv)*hd); gate, up,
                       silu(gate), gate*up (4I).
    logits peak      = T*V*4 (fp32 logits) without liger; with learner.use_liger the fused linear+CE head
                       works in chunks of c = min(T, next_pow2(ceil(T / ceil(V/h)))) tokens: 2*c*V*4 bytes
                       (the chunk's logits and their gradient).
    vLLM shard       = b_m*N / TP (b_m = bytes of model.dtype; embeddings are vocab-parallel, so all of N shards).
    vLLM KV budget   = generator.gpu_memory_utilization * cluster.gpu_memory_gib - vLLM shard (an upper bound:
                       vLLM also spends part of its fraction on activations and CUDA graphs).
    KV bytes/token   = 2 * L * ceil(nkv/TP) * hd * b_m per GPU (= 2*L*nkv*hd*b_m / TP when TP divides nkv;
                       vLLM replicates KV heads when TP > nkv). KV tokens = KV budget / KV bytes/token.
    CUDA context     = 0.5 GiB per process on a GPU outside vLLM's fraction (the learner rank; a sleeping vLLM).
Phases (colocated; the GPU's peak is the max over them):
    generation  : vLLM at its whole fraction + learner asleep (weights [+ grads under ZeRO-0..2, which
                  DeepSpeed keeps allocated] + optimizer unless learner.offload_optimizer, which moves it to
                  CPU while asleep) + the learner's CUDA context.
    weight_sync : vLLM woken with weights only (shard) + learner asleep + 2 weight buckets
                  (coordinator.weight_bucket_mb: the gathered bucket and its IPC/NCCL copy).
    training    : learner fully awake (states, ZeRO-3 gather, activations, logits) + vLLM asleep:
                  sleep_level 2 releases weights and KV (~0, its CUDA context remains); sleep_level 1 is
                  planned as releasing nothing: vLLM's whole fraction (weights + KV) stays resident.
                  Decision: vLLM documents level 1 as offloading weights to CPU and dropping the KV cache,
                  but the seed measured ~64 GiB still resident at 32B under level 1 and an OOM in the first
                  backward. A TP-4 weight shard is only ~15 GiB, so "weights kept" cannot explain 64 GiB
                  and would let the plan pass a configuration that OOMed; counting the whole fraction
                  reproduces that failure. The plan is meant to fail before a run does.
    async: engine GPUs are in generation alone (their fraction); learner GPUs in training alone.

Invariant: fits is True exactly when every GPU's every phase is within cluster.gpu_memory_gib, the vLLM
KV budget is positive and holds at least one max-length sequence (data.max_prompt_tokens +
generator.max_tokens; vLLM refuses to start otherwise), the placement is possible, and (CPU plans)
the CPU requests sum within the CPUs. Each failure is one line in `errors`, naming the phase, the GPU
and the numbers.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.config import ConfigError, RunConfig

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
# Plan


@dataclass
class ActorPlacement:
    actor: str  # "generator[3]", "learner", "scorer[0]", ...
    node: int
    gpus: list[int]  # local GPU indices on that node; [] for CPU-only actors
    num_cpus: float
    detail: str = ""


@dataclass
class GpuMemory:
    """One class of identical GPUs: their components per phase (GiB) and the peak."""
    role: str  # "engine+learner", "learner", "engine"
    gpus: list[tuple[int, int]]  # (node, local gpu)
    phases: dict[str, dict[str, float]]  # phase -> component -> GiB

    def phase_total(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak_gib(self) -> float:
        return self.phase_total(self.peak_phase)


@dataclass
class Plan:
    recipe: str
    mode: str
    model: ModelShape
    num_params: int
    gpu_memory_gib: float
    total_gpus: int
    learner_world_size: int
    placements: list[ActorPlacement]
    gpu_memory: list[GpuMemory]
    facts: dict[str, float | int | str] = field(default_factory=dict)  # KV tokens, bytes/token, ...
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_requested: float = 0.0
    cpu_available: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        d["model"]["num_params"] = self.num_params
        for g, gd in zip(self.gpu_memory, d["gpu_memory"]):
            gd["gpus"] = [list(x) for x in g.gpus]
            gd["phase_totals"] = {p: round(g.phase_total(p), 2) for p in g.phases}
            gd["peak_phase"], gd["peak_gib"] = g.peak_phase, round(g.peak_gib, 2)
        return d

    def render(self) -> str:
        m = self.model
        lines = [f"plan: {self.recipe}  mode={self.mode}  model={m.name} ({_count(self.num_params)} params: "
                 f"h={m.hidden_size} L={m.num_layers} heads={m.num_heads} kv_heads={m.num_kv_heads} "
                 f"head_dim={m.head_dim} I={m.intermediate_size} V={m.vocab_size}"
                 f"{' tied' if m.tie_word_embeddings else ''})"]
        if self.total_gpus:
            lines.append(f"GPUs: {self.total_gpus} ({self.gpu_memory_gib:g} GiB each); "
                         f"learner world size {self.learner_world_size}")
        else:
            lines.append(f"CPU only: {self.cpu_requested:g} CPUs requested of {self.cpu_available:g}")
        lines += ["", "placement:", f"  {'actor':<16} {'node':>4}  {'gpus':<12} {'cpus':>5}  detail"]
        for p in self.placements:
            lines.append(f"  {p.actor:<16} {p.node:>4}  {_ranges(p.gpus) or '-':<12} {p.num_cpus:>5g}  {p.detail}")
        for g in self.gpu_memory:
            lines += ["", f"memory per GPU, GiB — {g.role} GPUs ({len(g.gpus)}: {_gpu_list(g.gpus)}):"]
            phases = list(g.phases)
            components = list(dict.fromkeys(c for p in phases for c in g.phases[p]))
            lines.append(f"  {'component':<30}" + "".join(f"{p:>13}" for p in phases))
            for c in components:
                lines.append(f"  {c:<30}" + "".join(
                    f"{g.phases[p][c]:>13.2f}" if c in g.phases[p] else f"{'-':>13}" for p in phases))
            lines.append(f"  {'total':<30}" + "".join(f"{g.phase_total(p):>13.2f}" for p in phases))
            lines.append(f"  peak {g.peak_gib:.2f} GiB in {g.peak_phase} (limit {self.gpu_memory_gib:g})")
        if self.facts:
            lines += ["", "facts:"] + [f"  {k}: {_fmt(v)}" for k, v in self.facts.items()]
        if self.notes:
            lines += ["", "notes:"] + [f"  - {n}" for n in self.notes]
        lines.append("")
        if self.fits:
            lines.append("FITS")
        else:
            lines.append("DOES NOT FIT:")
            lines += [f"  - {e}" for e in self.errors]
        return "\n".join(lines)


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _ranges(ids: list[int]) -> str:
    if not ids:
        return ""
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _gpu_list(gpus: list[tuple[int, int]]) -> str:
    by_node: dict[int, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    return " ".join(f"node{n}:{_ranges(sorted(g))}" for n, g in sorted(by_node.items()))


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


def place_engines(num_engines: int, tp: int, num_nodes: int, gpus_per_node: int) -> list[tuple[int, list[int]]]:
    """First-fit: each engine's TP group on one node. Raises ValueError when they don't fit."""
    if tp > gpus_per_node:
        raise ValueError(f"generator.tensor_parallel_size={tp} exceeds cluster.gpus_per_node={gpus_per_node}: "
                         "a TP group never crosses a node")
    free = [gpus_per_node] * num_nodes
    placed = []
    for engine in range(num_engines):
        node = next((n for n in range(num_nodes) if free[n] >= tp), None)
        if node is None:
            raise ValueError(f"{num_engines} engines x TP {tp} = {num_engines * tp} GPUs do not fit on "
                             f"{num_nodes} node(s) x {gpus_per_node} GPUs (engine {engine} has no node)")
        first = gpus_per_node - free[node]
        placed.append((node, list(range(first, first + tp))))
        free[node] -= tp
    return placed


def _cpu_actors(cfg: RunConfig) -> list[ActorPlacement]:
    out = [ActorPlacement("coordinator", 0, [], cfg.coordinator.num_cpus, f"{cfg.coordinator.steps} steps")]
    out += [ActorPlacement(f"scorer[{i}]", 0, [], cfg.scorer.num_cpus, f"SQLite pool of {cfg.scorer.workers} processes")
            for i in range(cfg.scorer.num_scorers)]
    out.append(ActorPlacement("assembler", 0, [], cfg.assembler.num_cpus,
                              f"micro-batches of {cfg.assembler.micro_batch_tokens} tokens"))
    return out


def _cpu_plan(cfg: RunConfig, shape: ModelShape, recipe: str) -> Plan:
    gen = cfg.generator
    placements = [ActorPlacement(f"generator[{i}]", 0, [], gen.num_cpus, f"{gen.engine} engine")
                  for i in range(gen.num_engines)]
    placements.append(ActorPlacement("learner", 0, [], cfg.learner.num_cpus, f"ZeRO-{cfg.learner.zero_stage}, 1 rank"))
    placements += _cpu_actors(cfg)
    requested = sum(p.num_cpus for p in placements)
    available = float(cfg.cluster.num_cpus or os.cpu_count() or 1)
    n = shape.num_params
    states = learner_state_gib(cfg, n, 1)
    plan = Plan(recipe, cfg.coordinator.mode, shape, n, cfg.cluster.gpu_memory_gib, 0, 1, placements, [],
                cpu_requested=requested, cpu_available=available)
    plan.facts["model params"] = n
    plan.facts["learner states (host RAM), MiB"] = round(sum(states.values()) * 1024, 2)
    plan.facts["generator weights (host RAM), MiB"] = round(n * DTYPE_BYTES[cfg.model.dtype] / GIB * 1024, 2)
    if requested > available + 1e-9:
        plan.errors.append(f"CPU requests sum to {requested:g} but cluster.num_cpus gives {available:g}: "
                           + ", ".join(f"{p.actor}={p.num_cpus:g}" for p in placements))
    return plan


def make_plan(cfg: RunConfig, recipe: str | None = None) -> Plan:
    """The placement and per-GPU memory plan of `cfg` (see the module docstring for every formula)."""
    recipe = recipe or cfg.name
    shape = model_shape(cfg)
    cl, gen, lr = cfg.cluster, cfg.generator, cfg.learner
    if cl.gpus_per_node <= 0:
        return _cpu_plan(cfg, shape, recipe)

    n = shape.num_params
    total_gpus = cl.num_nodes * cl.gpus_per_node
    mem = cl.gpu_memory_gib
    tp = gen.tensor_parallel_size
    mode = cfg.coordinator.mode
    errors: list[str] = []
    all_gpus = [(node, g) for node in range(cl.num_nodes) for g in range(cl.gpus_per_node)]

    try:
        engines = place_engines(gen.num_engines, tp, cl.num_nodes, cl.gpus_per_node)
    except ValueError as e:
        engines = []
        errors.append(f"placement: {e}")
    engine_gpus = [(node, g) for node, gpus in engines for g in gpus]
    if mode == "colocated":
        learner_gpus = all_gpus
    else:
        taken = set(engine_gpus)
        learner_gpus = [x for x in all_gpus if x not in taken]
        if engines and not learner_gpus:
            errors.append(f"placement: async mode needs GPUs of its own for the learner, but {gen.num_engines} "
                          f"engines x TP {tp} take all {total_gpus} GPUs")
    world = len(learner_gpus)
    divisor = max(1, world)  # async with no learner GPU is already an error; keep the arithmetic finite

    placements = [ActorPlacement(f"generator[{i}]", node, gpus, gen.num_cpus, f"{gen.engine} TP {tp}")
                  for i, (node, gpus) in enumerate(engines)]
    for node in range(cl.num_nodes):
        local = [g for (nd, g) in learner_gpus if nd == node]
        if local:
            first_rank = learner_gpus.index((node, local[0]))
            placements.append(ActorPlacement(
                "learner", node, local, lr.num_cpus * len(local),
                f"ranks {first_rank}-{first_rank + len(local) - 1} of {world}, ZeRO-{lr.zero_stage}"))
    placements += _cpu_actors(cfg)

    # vLLM per engine GPU
    b_model = DTYPE_BYTES[cfg.model.dtype]
    vllm_fraction = gen.gpu_memory_utilization * mem
    vllm_shard = b_model * n / tp / GIB
    kv_budget = vllm_fraction - vllm_shard
    kv_per_token = kv_bytes_per_token(shape, tp, b_model)
    kv_tokens = int(max(0.0, kv_budget) * GIB // kv_per_token)
    max_seq = cfg.data.max_prompt_tokens + gen.max_tokens
    facts: dict[str, float | int | str] = {
        "model params": n,
        "vLLM weights total, GiB": round(b_model * n / GIB, 2),
        "vLLM weights per TP shard, GiB": round(vllm_shard, 2),
        "vLLM fraction, GiB": round(vllm_fraction, 2),
        "vLLM KV budget per GPU, GiB": round(kv_budget, 2),
        "KV bytes per token per GPU": kv_per_token,
        "KV cache tokens per engine": kv_tokens,  # every GPU of the TP group holds the same tokens
        "max sequence (prompt + response) tokens": max_seq,
        "max-length sequences in KV per engine": kv_tokens // max_seq,
    }
    if engines and not 0 < gen.gpu_memory_utilization <= 1:
        errors.append(f"generation phase: generator.gpu_memory_utilization={gen.gpu_memory_utilization} must be in (0, 1]")
    if engines and kv_budget <= 0:
        errors.append(f"generation phase, GPU node{engines[0][0]}:{engines[0][1][0]}: vLLM's fraction "
                      f"{gen.gpu_memory_utilization} x {mem:g} = {vllm_fraction:.2f} GiB does not hold its weight "
                      f"shard of {vllm_shard:.2f} GiB (KV budget {kv_budget:.2f} GiB)")
    elif engines and kv_tokens < max_seq:
        errors.append(f"generation phase, GPU node{engines[0][0]}:{engines[0][1][0]}: KV cache holds {kv_tokens} "
                      f"tokens < one max-length sequence of {max_seq} (data.max_prompt_tokens + generator.max_tokens)")

    # learner per rank
    states = learner_state_gib(cfg, n, divisor)
    asleep = {"learner weights": states["learner weights"]}
    if lr.zero_stage < 3:  # DeepSpeed keeps the gradient buffers of stages 0-2 allocated between steps
        asleep["learner grads"] = states["learner grads"]
    if not lr.offload_optimizer:
        asleep["learner optimizer"] = states["learner optimizer"]
    asleep["learner CUDA context"] = CUDA_CONTEXT_GIB
    awake = dict(states)
    if lr.zero_stage >= 3:
        awake["ZeRO-3 gather working set"] = zero3_gather_gib(cfg, shape)
    awake[_activations_label(cfg, shape)] = \
        activation_gib(cfg, shape)
    awake["logits peak" + (" (liger chunks)" if lr.use_liger else " (full fp32)")] = logits_gib(cfg, shape)
    awake["learner CUDA context"] = CUDA_CONTEXT_GIB
    vllm_asleep = {"vLLM CUDA context (asleep)": CUDA_CONTEXT_GIB}
    if gen.sleep_level == 1:
        vllm_asleep["vLLM weights kept (sleep_level 1)"] = vllm_shard
        vllm_asleep["vLLM KV kept (sleep_level 1)"] = max(0.0, kv_budget)
    bucket = 2 * cfg.coordinator.weight_bucket_mb / 1024

    vllm_awake = {"vLLM weights shard": vllm_shard, "vLLM KV cache": max(0.0, kv_budget)}
    if kv_budget < 0:
        vllm_awake = {"vLLM weights shard": vllm_shard}
    gpu_memory: list[GpuMemory] = []
    engine_set = set(engine_gpus)
    if mode == "colocated":
        shared = [x for x in all_gpus if x in engine_set]
        alone = [x for x in all_gpus if x not in engine_set]
        if shared:
            gpu_memory.append(GpuMemory("engine+learner", shared, {
                "generation": {**vllm_awake, **asleep},
                "weight_sync": {"vLLM weights shard": vllm_shard, **asleep, "weight buckets (x2)": bucket},
                "training": {**vllm_asleep, **awake},
            }))
        if alone:
            gpu_memory.append(GpuMemory("learner", alone, {"generation": dict(asleep),
                                                           "weight_sync": {**asleep, "weight buckets (x2)": bucket},
                                                           "training": dict(awake)}))
    else:
        if engine_gpus:
            gpu_memory.append(GpuMemory("engine", engine_gpus, {"generation": dict(vllm_awake)}))
        if learner_gpus:
            gpu_memory.append(GpuMemory("learner", learner_gpus,
                                        {"training": dict(awake),
                                         "weight_sync": {**asleep, "weight buckets (x2)": bucket}}))

    for g in gpu_memory:
        for phase in g.phases:
            total = g.phase_total(phase)
            if total > mem + 1e-9:
                node, local = g.gpus[0]
                parts = ", ".join(f"{c} {v:.2f}" for c, v in sorted(g.phases[phase].items(), key=lambda kv: -kv[1]))
                more = f" (and {len(g.gpus) - 1} more {g.role} GPUs like it)" if len(g.gpus) > 1 else ""
                errors.append(f"{phase} phase, GPU node{node}:{local}{more}: needs {total:.2f} GiB > "
                              f"cluster.gpu_memory_gib={mem:g} ({parts})")

    notes = [f"learner ZeRO-{lr.zero_stage} over {world} ranks; T = {cfg.assembler.micro_batch_tokens} tokens "
             f"per micro-batch per rank; gradient checkpointing {_checkpointing_note(cfg, shape)}; "
             f"liger {'on' if lr.use_liger else 'off'}"]
    if mode == "colocated":
        notes.append(f"vLLM sleep_level {gen.sleep_level}: " + (
            "weights and KV released while the learner trains" if gen.sleep_level == 2 else
            "planned as keeping vLLM's whole fraction resident (the seed measured ~64 GiB resident and "
            "an OOM at 32B); prefer sleep_level 2"))
    if lr.offload_optimizer:
        per_node = max(sum(1 for nd, _ in learner_gpus if nd == node) for node in range(cl.num_nodes))
        notes.append(f"optimizer offloaded to host RAM while asleep: {states['learner optimizer'] * per_node:.1f} "
                     f"GiB per node")
    plan = Plan(recipe, mode, shape, n, mem, total_gpus, world, placements, gpu_memory, facts, notes, errors)
    if cl.num_cpus and cl.num_nodes == 1:
        plan.cpu_requested = sum(p.num_cpus for p in placements)
        plan.cpu_available = float(cl.num_cpus)
        if plan.cpu_requested > plan.cpu_available + 1e-9:
            errors.append(f"CPU requests sum to {plan.cpu_requested:g} but cluster.num_cpus gives {cl.num_cpus}")
    return plan
