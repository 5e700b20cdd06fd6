"""Where every actor of a run sits: ONE pure function, `make_placement(cfg) -> Placement`.

`--dry-run` renders it (launch/plan.py adds the memory arithmetic), `--preflight` builds it with probe
actors (launch/preflight.py), the launcher builds it for real (launch/place.py). Nothing here imports Ray.

GPU recipes (cluster.gpus_per_node > 0)
    Nodes are cluster.num_nodes x cluster.gpus_per_node. Every node gets ONE placement group
    (STRICT_PACK: all its bundles on one Ray node) whose bundle i is local GPU slot i,
    `{"GPU": 1, "CPU": c}`; node 0's group ends with one CPU-only bundle for the coordinator, the
    scorers and the assembler (the sum of their num_cpus), so those actors never take a CPU a GPU
    bundle reserved for its ranks or TP workers.
    Engines (generator.num_engines, each generator.tensor_parallel_size = k GPUs) are packed
    first-fit onto nodes, so a TP group is k consecutive bundles of ONE node. An engine's actor sits
    on its first bundle; its TP workers use the other k-1 bundles' GPUs: the generator gets
    `device_ids` (the node-local GPU ids Ray assigned to its k bundles, probed at launch) and sets
    CUDA_VISIBLE_DEVICES from them before vLLM starts its workers (vLLM's mp executor; vLLM also
    documents VLLM_RAY_BUNDLE_INDICES + VLLM_RAY_PER_WORKER_GPUS for its Ray executor, which
    OpenRLHF and SkyRL use: `bundles` below are those indices).
    colocated: learner rank i on bundle i of the GPUs in node order (world size = every GPU); a
        bundle an engine covers has c = learner.num_cpus + generator.num_cpus and is shared 0.5/0.5
        GPU by the rank and (on the engine's first bundle) the engine's actor; a bundle no engine
        covers has c = learner.num_cpus and the rank takes the whole GPU.
    async: the engines' bundles (c = generator.num_cpus, the actor takes 1 GPU) come first on each
        node, the learner ranks take every remaining GPU (c = learner.num_cpus, 1 GPU each), in
        node order; world size = total - engine GPUs.
    async on shared GPUs (`Placement.shared`): when the engines take every GPU (one GPU, one engine:
        gpu1_0p6b coordinator.mode=async), the learner ranks sit on the engines' GPUs as colocated
        ones do (rank i on bundle i, 0.5/0.5 with the engine covering it), but nothing sleeps: the
        engine keeps its weights and KV cache resident and the learner its state, so both must fit
        one GPU together (config.memory.shared_async_budget; config.validate.check_inputs refuses a
        setting that cannot fit, naming the fields).
CPU recipes (gpus_per_node == 0)
    No placement group: `learner.num_ranks` rank processes and every other actor ask Ray for their
    num_cpus alone (node 0), as before placement groups existed. When their sum exceeds a set
    cluster.num_cpus, `fit_cpu_asks` scales every role's ask down by one factor (Ray takes fractional CPU
    asks; CPU_GRAIN steps) so they fit: config.validate writes the result into the config once, so
    --dry-run, the saved config and the launcher see the same asks (`tiny learner.num_ranks=2` on 2 CPUs).
    With cluster.num_cpus=0 a local cluster is given enough logical CPUs instead (`local_num_cpus`).

Weight sync follows from the placement (`weight_sync`): coordinator.weight_sync="auto" resolves to
cuda_ipc when every engine GPU holds a learner rank (colocated on GPUs, or async on shared GPUs), nccl
when async on GPUs of their own, object_store on CPU. An explicit request that cannot work is a
ConfigError naming `coordinator.weight_sync`: cuda_ipc needs every engine GPU to hold a learner rank;
nccl between processes sharing a GPU is refused by NCCL; on CPU nccl means the gloo broadcast.

Invariants: every GPU bundle is used by at least one actor; no GPU slot is given to two actors except
a rank and the engine covering it (0.5 + 0.5: colocated, or async on shared GPUs); an engine's bundles are on one node; actor
names are unique; `errors` lists every reason the placement is impossible, one line each (the
placement is still returned so the plan can be printed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from config.schema import ConfigError, RunConfig


@dataclass(frozen=True)
class ActorSlot:
    """One actor: where it sits and what it asks Ray for."""

    name: str  # "learner-3", "generator-1", "scorer-0", "assembler", "coordinator"
    role: str  # "learner", "generator", "scorer", "assembler", "coordinator"
    node: int
    bundle: int | None  # index into its node's placement group; None: no placement group (CPU recipes)
    gpus: tuple[int, ...] = ()  # node-local GPU slots it covers (an engine: its k TP bundles)
    num_gpus: float = 0.0
    num_cpus: float = 0.0
    rank: int | None = None  # learner rank / engine index


@dataclass
class Placement:
    mode: str
    num_nodes: int
    gpus_per_node: int
    bundles: list[list[dict[str, float]]]  # per node; [] for every node of a CPU recipe
    actors: list[ActorSlot]
    learner_world_size: int
    weight_sync: str
    cpu_bundle: int | None = None  # node 0's CPU-only bundle (None: CPU recipe)
    errors: list[str] = field(default_factory=list)
    shared: bool = False  # async with the learner ranks on the engines' GPUs (nothing sleeps)

    @property
    def gpu_shared(self) -> bool:
        """A learner rank and an engine share a GPU (colocated with engines, or async on shared GPUs): the
        launcher builds the learner and puts it to sleep before any engine starts (launch/place.py)."""
        return self.gpu and any(a.num_gpus < 1.0 for a in self.by_role("learner"))

    @property
    def gpu(self) -> bool:
        return self.gpus_per_node > 0

    def by_role(self, role: str) -> list[ActorSlot]:
        return [a for a in self.actors if a.role == role]

    def actor(self, name: str) -> ActorSlot:
        return next(a for a in self.actors if a.name == name)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node,
                "bundles": self.bundles, "learner_world_size": self.learner_world_size,
                "weight_sync": self.weight_sync, "cpu_bundle": self.cpu_bundle, "errors": list(self.errors),
                "shared": self.shared,
                "actors": [{"name": a.name, "role": a.role, "node": a.node, "bundle": a.bundle, "gpus": list(a.gpus),
                            "num_gpus": a.num_gpus, "num_cpus": a.num_cpus, "rank": a.rank} for a in self.actors]}


def place_engines(num_engines: int, tp: int, num_nodes: int, gpus_per_node: int) -> list[tuple[int, list[int]]]:
    """First-fit: each engine's TP group on one node. Raises ValueError when they don't fit."""
    if tp < 1:
        raise ValueError(f"generator.tensor_parallel_size={tp} must be >= 1")
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


def _cpu_side(cfg: RunConfig, bundle: int | None) -> list[ActorSlot]:
    out = [ActorSlot("coordinator", "coordinator", 0, bundle, num_cpus=cfg.coordinator.num_cpus)]
    out += [ActorSlot(f"scorer-{i}", "scorer", 0, bundle, num_cpus=cfg.scorer.num_cpus, rank=i)
            for i in range(cfg.scorer.num_scorers)]
    out.append(ActorSlot("assembler", "assembler", 0, bundle, num_cpus=cfg.assembler.num_cpus))
    return out


def shares_gpus(cfg: RunConfig) -> bool:
    """Async on GPUs with the engines on every GPU: the learner ranks share the engines' GPUs (module
    docstring). False for colocated runs, CPU recipes and engines that do not fit at all."""
    cl, gen = cfg.cluster, cfg.generator
    if cfg.coordinator.mode != "async" or cl.gpus_per_node <= 0 or gen.num_engines < 1:
        return False
    try:
        engines = place_engines(gen.num_engines, gen.tensor_parallel_size, cl.num_nodes, cl.gpus_per_node)
    except ValueError:
        return False
    return sum(len(gpus) for _, gpus in engines) == cl.num_nodes * cl.gpus_per_node


def resolve_weight_sync(cfg: RunConfig, gpu: bool) -> str:
    """The transport the placement implies, or the one asked for when it can work (else ConfigError)."""
    asked, mode = cfg.coordinator.weight_sync, cfg.coordinator.mode
    shared = mode == "colocated" or shares_gpus(cfg)
    implied = "object_store" if not gpu else ("cuda_ipc" if shared else "nccl")
    if cfg.learner.lora.rank > 0:
        # LoRA: each sync is the adapter alone (megabytes), staged whole in the generator's process and handed
        # to its engine there (vLLM loads adapters by LoRARequest, not through its workers' model.load_weights)
        if asked not in ("auto", "object_store"):
            raise ConfigError(f"config key 'coordinator.weight_sync': learner.lora syncs the adapter alone through "
                              f"the Ray object store; {asked} moves whole models: use object_store (or auto)")
        return "object_store"
    if asked == "auto":
        return implied
    where = f"{mode}{' on shared GPUs' if shared and mode == 'async' else ''} on {'GPUs' if gpu else 'CPU'}"
    if asked == "cuda_ipc" and implied != "cuda_ipc":
        raise ConfigError(f"config key 'coordinator.weight_sync': cuda_ipc needs every engine on its learner rank's "
                          f"GPU (colocated, or async with the engines on every GPU), but the placement is {where}; "
                          f"use {implied} (or auto)")
    if asked == "nccl" and gpu and shared:
        raise ConfigError(f"config key 'coordinator.weight_sync': nccl cannot broadcast between processes sharing a "
                          f"GPU ({where}); use cuda_ipc (or auto)")
    return asked


def _num_ranks(cfg: RunConfig) -> int:
    return int(getattr(cfg.learner, "num_ranks", 1))


def make_placement(cfg: RunConfig) -> Placement:
    """The placement of `cfg` (see the module docstring for every rule)."""
    cl, gen, lr = cfg.cluster, cfg.generator, cfg.learner
    mode = cfg.coordinator.mode
    if cl.num_nodes < 1:
        raise ConfigError(f"config key 'cluster.num_nodes': {cl.num_nodes} must be >= 1")
    if cl.gpus_per_node < 0:
        raise ConfigError(f"config key 'cluster.gpus_per_node': {cl.gpus_per_node} must be >= 0")
    weight_sync = resolve_weight_sync(cfg, cl.gpus_per_node > 0)
    if cl.gpus_per_node == 0:
        ranks = _num_ranks(cfg)
        if ranks < 1:
            raise ConfigError(f"config key 'learner.num_ranks': {ranks} must be >= 1")
        actors = [ActorSlot(f"generator-{i}", "generator", 0, None, num_cpus=gen.num_cpus, rank=i)
                  for i in range(gen.num_engines)]
        actors += [ActorSlot(f"learner-{r}", "learner", 0, None, num_cpus=lr.num_cpus, rank=r) for r in range(ranks)]
        actors += _cpu_side(cfg, None)
        return Placement(mode, cl.num_nodes, 0, [[] for _ in range(cl.num_nodes)], actors, ranks, weight_sync)

    errors: list[str] = []
    tp = gen.tensor_parallel_size
    try:
        engines = place_engines(gen.num_engines, tp, cl.num_nodes, cl.gpus_per_node)
    except ValueError as e:
        engines, errors = [], [f"placement: {e}"]
    covered = {(node, g) for node, gpus in engines for g in gpus}
    all_gpus = [(node, g) for node in range(cl.num_nodes) for g in range(cl.gpus_per_node)]
    shared = shares_gpus(cfg)
    learner_gpus = all_gpus if mode == "colocated" or shared else [x for x in all_gpus if x not in covered]
    world = len(learner_gpus)
    ranks = _num_ranks(cfg)
    if ranks not in (1, world) and world:
        raise ConfigError(f"config key 'learner.num_ranks': {ranks}, but the placement gives the learner {world} GPUs "
                          f"(on GPUs the placement decides: leave it at 1 or set {world})")

    bundles: list[list[dict[str, float]]] = []
    for node in range(cl.num_nodes):
        row = []
        for g in range(cl.gpus_per_node):
            cpus = (lr.num_cpus if (node, g) in learner_gpus else 0.0) + (gen.num_cpus if (node, g) in covered else 0.0)
            row.append({"GPU": 1.0, "CPU": cpus} if cpus else {"GPU": 1.0})
        bundles.append(row)
    cpu_side = _cpu_side(cfg, cl.gpus_per_node)
    bundles[0].append({"CPU": sum(a.num_cpus for a in cpu_side)})

    share = 0.5 if mode == "colocated" or shared else 1.0
    actors = [ActorSlot(f"generator-{i}", "generator", node, gpus[0], tuple(gpus), share, gen.num_cpus, i)
              for i, (node, gpus) in enumerate(engines)]
    actors += [ActorSlot(f"learner-{r}", "learner", node, g, (g,), share if (node, g) in covered else 1.0,
                         lr.num_cpus, r) for r, (node, g) in enumerate(learner_gpus)]
    actors += cpu_side
    return Placement(mode, cl.num_nodes, cl.gpus_per_node, bundles, actors, world, weight_sync,
                     cpu_bundle=cl.gpus_per_node, errors=errors, shared=shared)


CPU_GRAIN = 0.001  # the step of a sized CPU ask (Ray's own resource grain is 0.0001)


def fit_cpu_asks(placement: Placement, cpus: float) -> dict[str, float]:
    """Each role's CPU ask (role -> num_cpus, the config section of the same name) scaled down by one factor
    so a CPU recipe's actors ask for at most `cpus` in all, each ask rounded down to CPU_GRAIN (never below
    it). {} when they already fit, when `cpus` <= 0 (not set), and for GPU recipes (their placement groups
    reserve what the plan says)."""
    import math

    if placement.gpu or cpus <= 0:
        return {}
    want = sum(a.num_cpus for a in placement.actors)
    if want <= cpus + 1e-9:
        return {}
    factor = cpus / want
    asks = {a.role: a.num_cpus for a in placement.actors}
    return {role: round(max(CPU_GRAIN, math.floor(ask * factor / CPU_GRAIN + 1e-9) * CPU_GRAIN), 6)
            for role, ask in asks.items()}


def local_num_cpus(placement: Placement, host_cpus: float) -> int | None:
    """The logical CPUs a new local Ray cluster gets for a CPU recipe whose actors ask for more than the
    host's `host_cpus` (as Ray counts them, cgroup limits included): their sum, rounded up (Ray's CPUs are
    a scheduling count, not cores, and a request that never fits would only fail the run). None (Ray
    counts the host) when they fit, and for GPU recipes."""
    import math

    if placement.gpu:
        return None
    want = math.ceil(sum(a.num_cpus for a in placement.actors) - 1e-9)
    return want if want > host_cpus else None
