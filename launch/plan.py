"""The --dry-run plan: which actor runs where, and what each GPU holds in each phase. Pure arithmetic.

`make_plan(cfg) -> Plan`; `Plan.render()` is the table `python -m launch.cluster RECIPE --dry-run`
prints (drawn by launch/plan_table.py), `Plan.to_dict()` the same as builtins, `Plan.fits` the verdict
(the CLI's exit code).

Placement
    Taken whole from config.placement.make_placement (the function the launcher and --preflight build):
    nodes, one placement-group bundle per GPU, which actor on which bundle / node-local GPU, each
    actor's Ray request (GPU fraction, CPUs), the learner world size W and the weight-sync transport.
    Its errors (engines that do not fit, async without learner GPUs) are plan errors; its rows are
    launch/plan_table.py's placement_rows. With no GPUs (tiny) the plan is CPU only: every actor's Ray
    CPU request (already sized to a set cluster.num_cpus by validation), summed against cluster.num_cpus
    (0: this machine's CPUs, or the logical CPUs a local cluster is given when the asks are more).

Memory, per GPU, in GiB (2**30 bytes). N = parameters, W = learner world size, T = assembler.micro_batch_tokens,
h = hidden, L = layers, I = intermediate, V = vocab, hd = head_dim, nh/nkv = attention/KV heads, b = bytes of dtype.
    N                = V*h (embedding) [+ V*h lm_head if untied] + L*(h*nh*hd + 2*h*nkv*hd + nh*hd*h + 3*h*I
                       + 2*h + 2*hd) + h                        (Qwen3: no biases; q_norm/k_norm of size hd)
    learner states   = weights b_l*N + grads b_l*N + optimizer k*N, with b_l = bytes of learner.dtype and
                       k = 12 for bf16 mixed precision (fp32 master + 2 fp32 moments), 8 for fp32 (2 moments);
                       ZeRO-1 divides the optimizer by W, ZeRO-2 also the grads, ZeRO-3 also the weights.
                       learner.lora (rank r): grads and optimizer of the adapter's A = L * sum over targeted
                       projections of r*(in + out) parameters alone, weights b_l*(N + A); no base state.
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
    CUDA context     = 0.5 GiB per process on a GPU outside vLLM's fraction (the learner rank; vLLM, awake or
                       asleep: vLLM measures its fraction from a snapshot taken after its context exists).
    learner build    = the learner's states + 8 bytes a parameter (of this rank's partition under ZeRO-1+) + its
                       context: DeepSpeed steps Adam once on zero gradients at build, so masters and moments are
                       there, the zero gradients (bf16 and fp32) and the step's temporaries in the allocator's
                       cache (config.memory.learner_build_gib; fp32 at ZeRO-0: the weights alone).
Phases (colocated; the GPU's peak is the max over them; learner build and checkpoint: config.memory's
startup_and_checkpoint_phases):
    learner build: the learner alone on its GPU: the launcher builds it and puts it to sleep before any engine
                  starts there (launch/create.py), so the engines start beside a sleeping learner (the
                  generation phase) and the warm start runs with the engines asleep (a training phase).
    generation  : vLLM at its whole fraction + its context + learner asleep (weights [+ grads under ZeRO-0..2, which
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
    async on shared GPUs (config.placement's `shared`: the engines on every GPU; config.memory's
    shared_async_phases): learner build, then "generation+training" (vLLM's whole fraction and context +
    the learner awake: nothing sleeps, the warm start included) and weight_sync (the same + 2 buckets). The
    per-process budgets are facts: vLLM's fraction + context, the learner the rest of the GPU; a learner
    that does not fit its budget is an error naming generator.gpu_memory_utilization and
    assembler.micro_batch_tokens (config.validate.check_inputs refuses such a run in the same line).
    "peak before step 1" (facts) is the max over every phase but a mid-run checkpoint.

Invariant: fits is True exactly when every GPU's every phase is within cluster.gpu_memory_gib, the vLLM
KV budget is positive and holds at least one max-length sequence (data.max_prompt_tokens +
generator.max_tokens; vLLM refuses to start otherwise), the placement is possible, and (CPU plans)
the CPU requests sum within the CPUs. Each failure is one line in `errors`, naming the phase, the GPU
and the numbers.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from config import RunConfig
from config.memory import (
    CUDA_CONTEXT_GIB,
    DTYPE_BYTES,
    GIB,
    ModelShape,
    _checkpointing_note,
    kv_bytes_per_token,
    learner_asleep_awake_gib,
    learner_build_gib,
    learner_state_gib,
    lora_params,
    model_shape,
    shared_async_budget,
    shared_async_phases,
    startup_and_checkpoint_phases,
    trainable_params,
    vllm_awake_gib,
)
from config.placement import Placement, local_num_cpus, make_placement
from launch.plan_table import ActorPlacement, placement_rows, render_plan


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
    placement: Placement | None = None  # what the launcher and --preflight build

    @property
    def fits(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        d = asdict(self)
        d["placement"] = self.placement.to_dict() if self.placement is not None else None
        d["fits"] = self.fits
        d["model"]["num_params"] = self.num_params
        for g, gd in zip(self.gpu_memory, d["gpu_memory"]):
            gd["gpus"] = [list(x) for x in g.gpus]
            gd["phase_totals"] = {p: round(g.phase_total(p), 2) for p in g.phases}
            gd["peak_phase"], gd["peak_gib"] = g.peak_phase, round(g.peak_gib, 2)
        return d

    def render(self) -> str:
        return render_plan(self)


def _cpu_plan(cfg: RunConfig, shape: ModelShape, recipe: str, placement: Placement) -> Plan:
    placements = placement_rows(cfg, placement)
    requested = sum(a.num_cpus for a in placement.actors)
    host = float(os.cpu_count() or 1)  # cluster.num_cpus=0: a local cluster gets enough (local_num_cpus)
    available = float(cfg.cluster.num_cpus or local_num_cpus(placement, host) or host)
    n = shape.num_params
    world = placement.learner_world_size
    states = learner_state_gib(cfg, n, world, trainable_params(cfg, shape))
    plan = Plan(recipe, cfg.coordinator.mode, shape, n, cfg.cluster.gpu_memory_gib, 0, world, placements, [],
                cpu_requested=requested, cpu_available=available, placement=placement)
    plan.facts["model params"] = n
    _lora_facts(cfg, shape, plan.facts, plan.notes)
    plan.facts["learner states per rank (host RAM), MiB"] = round(sum(states.values()) * 1024, 2)
    plan.facts["generator weights (host RAM), MiB"] = round(n * DTYPE_BYTES[cfg.model.dtype] / GIB * 1024, 2)
    if requested > available + 1e-9:
        plan.errors.append(f"CPU requests sum to {requested:g} but cluster.num_cpus gives {available:g}: "
                           + ", ".join(f"{a.name}={a.num_cpus:g}" for a in placement.actors))
    return plan


def _lora_facts(cfg: RunConfig, shape: ModelShape, facts: dict, notes: list[str]) -> None:
    """learner.lora: the adapter's size, and what it takes out of the learner's states and each sync."""
    adapter = lora_params(cfg, shape)
    if not adapter:
        return
    b = DTYPE_BYTES[cfg.learner.dtype]
    facts["LoRA adapter params"] = adapter
    facts["weight sync per step (the adapter), MiB"] = round(adapter * b / 2**20, 2)
    notes.append(f"LoRA rank {cfg.learner.lora.rank}: {adapter:,} adapter parameters ({100 * adapter / shape.num_params:.2f} % "
                 f"of the base), the only ones with gradients and optimizer state in RL; the base is frozen and stays out of "
                 f"checkpoints; each weight sync is the adapter, {adapter * b / 2**20:.2f} MiB (a tiny warm start "
                 f"trains the base first, with an optimizer of its own not planned here, and sends it once)")


def make_plan(cfg: RunConfig, recipe: str | None = None) -> Plan:
    """The placement and per-GPU memory plan of `cfg` (see the module docstring for every formula)."""
    recipe = recipe or cfg.name
    shape = model_shape(cfg)
    cl, gen, lr = cfg.cluster, cfg.generator, cfg.learner
    placement = make_placement(cfg)
    if cl.gpus_per_node <= 0:
        return _cpu_plan(cfg, shape, recipe, placement)

    n = shape.num_params
    total_gpus = cl.num_nodes * cl.gpus_per_node
    mem = cl.gpu_memory_gib
    tp = gen.tensor_parallel_size
    mode = cfg.coordinator.mode
    errors: list[str] = list(placement.errors)
    all_gpus = [(node, g) for node in range(cl.num_nodes) for g in range(cl.gpus_per_node)]
    engines = [(a.node, list(a.gpus)) for a in placement.by_role("generator")]
    engine_gpus = [(node, g) for node, gpus in engines for g in gpus]
    learner_gpus = [(a.node, a.gpus[0]) for a in placement.by_role("learner")]
    world = placement.learner_world_size
    divisor = max(1, world)  # async with no learner GPU is already an error; keep the arithmetic finite
    placements = placement_rows(cfg, placement)

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
    states = learner_state_gib(cfg, n, divisor, trainable_params(cfg, shape))
    asleep, awake = learner_asleep_awake_gib(cfg, shape, divisor)
    build = learner_build_gib(cfg, n, divisor, trainable_params(cfg, shape))
    vllm_asleep = {"vLLM CUDA context (asleep)": CUDA_CONTEXT_GIB}
    if gen.sleep_level == 1:
        vllm_asleep["vLLM weights kept (sleep_level 1)"] = vllm_shard
        vllm_asleep["vLLM KV kept (sleep_level 1)"] = max(0.0, kv_budget)
    bucket = 2 * cfg.coordinator.weight_bucket_mb / 1024

    vllm_awake = vllm_awake_gib(cfg, shape)
    gpu_memory: list[GpuMemory] = []
    engine_set = set(engine_gpus)
    if mode == "colocated" or placement.shared:
        shared = [x for x in all_gpus if x in engine_set]
        alone = [x for x in all_gpus if x not in engine_set]
        if shared and placement.shared:
            phases = shared_async_phases(build, vllm_awake, awake, bucket)
            gpu_memory.append(GpuMemory("engine+learner", shared, phases))
            vllm_total, learner_total = sum(vllm_awake.values()), sum(awake.values()) + bucket
            facts["per-process budget, GiB: vLLM (fraction + context)"] = round(vllm_total, 2)
            facts["per-process budget, GiB: learner (the rest of the GPU)"] = round(mem - vllm_total, 2)
            facts["learner awake + weight buckets, GiB"] = round(learner_total, 2)
            why = shared_async_budget(cfg, vllm_total, learner_total)
            if why:
                errors.append(why)
        elif shared:
            generation = {**vllm_awake, **asleep}
            gpu_memory.append(GpuMemory("engine+learner", shared, {
                "generation": generation,
                "weight_sync": {"vLLM weights shard": vllm_shard, "vLLM CUDA context": CUDA_CONTEXT_GIB, **asleep,
                                "weight buckets (x2)": bucket},
                "training": {**vllm_asleep, **awake},
                **startup_and_checkpoint_phases(cfg, build, generation, states["learner optimizer"]),
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
    _lora_facts(cfg, shape, facts, notes)
    if placement.shared:
        notes.append("async on shared GPUs: the engine and the learner rank share each GPU and neither sleeps "
                     "(vLLM's weights and KV cache and the learner's state stay resident; the learner is built and "
                     "asleep before the engine starts); weights go over CUDA IPC between steps while the engine "
                     "parks its requests")
    if mode == "colocated":
        notes.append(f"vLLM sleep_level {gen.sleep_level}: " + (
            "weights and KV released while the learner trains (and during a warm start; the learner sleeps "
            "before step 1, the engines before the final checkpoint)" if gen.sleep_level == 2 else
            "planned as keeping vLLM's whole fraction resident (the seed measured ~64 GiB resident and "
            "an OOM at 32B); " + ("learner.lora sets it: no sync brings the frozen base back after a level-2 sleep"
                                  if lr.lora.rank > 0 else "prefer sleep_level 2")))
    if lr.offload_optimizer and not placement.shared:
        per_node = max(sum(1 for nd, _ in learner_gpus if nd == node) for node in range(cl.num_nodes))
        notes.append(f"optimizer offloaded to host RAM while asleep: {states['learner optimizer'] * per_node:.1f} "
                     f"GiB per node")
    for g in gpu_memory:  # what the run's start holds at most: every phase but a mid-run checkpoint
        facts[f"{g.role} GPU peak before step 1, GiB"] = round(max(
            g.phase_total(p) for p in g.phases if p not in ("checkpoint",)), 2)
    plan = Plan(recipe, mode, shape, n, mem, total_gpus, world, placements, gpu_memory, facts, notes, errors,
                placement=placement)
    if cl.num_cpus and cl.num_nodes == 1:
        plan.cpu_requested = sum(b.get("CPU", 0.0) for b in placement.bundles[0])  # what the group reserves
        plan.cpu_available = float(cl.num_cpus)
        if plan.cpu_requested > plan.cpu_available + 1e-9:
            errors.append(f"CPU: node 0's placement group reserves {plan.cpu_requested:g} CPUs but cluster.num_cpus "
                          f"gives {cl.num_cpus}")
    return plan
