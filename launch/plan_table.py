"""The --dry-run plan as a table: the placement's rows and the text `python -m launch.cluster RECIPE --dry-run`
prints (`render_plan`, which launch/plan.py's `Plan.render()` returns).

Rows: one per engine, one per node for the learner ranks (each rank's request shown), one per CPU actor,
each with its node, placement-group bundle(s), node-local GPUs, Ray GPU and CPU request and a detail.
Then, per class of identical GPUs, its components per phase (GiB), the totals and the peak; the facts,
the notes and the verdict (FITS, or DOES NOT FIT with every error).

Invariant: presentation only. Nothing here computes memory or decides whether a plan fits (launch/plan.py
does, from config.memory's formulas); it reads a Plan and the placement and writes text and rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from config import RunConfig
from config.placement import ActorSlot, Placement


@dataclass
class ActorPlacement:
    """One row of the rendered placement (the learner's ranks on one node share a row)."""
    actor: str  # "generator-3", "learner-0..7", "scorer-0", ...
    node: int
    gpus: list[int]  # local GPU indices on that node; [] for CPU-only actors
    num_cpus: float  # per actor (per rank for a learner row)
    detail: str = ""
    num_gpus: float = 0.0  # per actor (per rank)
    bundle: str = "-"  # placement-group bundle(s) on the node; "cpu" for node 0's CPU bundle


def placement_rows(cfg: RunConfig, placement: Placement) -> list[ActorPlacement]:
    """The placement as table rows: one per engine, one per node of learner ranks, one per CPU actor."""
    gen, lr, world = cfg.generator, cfg.learner, placement.learner_world_size

    def bundles(a: ActorSlot) -> str:
        if a.bundle is None:
            return "-"
        return "cpu" if a.bundle == placement.cpu_bundle else _ranges(list(a.gpus) or [a.bundle])
    rows = []
    detail = {"generator": f"{gen.engine} TP {gen.tensor_parallel_size}",
              "coordinator": f"{cfg.coordinator.steps} steps",
              "scorer": f"SQLite pool of {cfg.scorer.workers} processes",
              "assembler": f"micro-batches of {cfg.assembler.micro_batch_tokens} tokens"}
    for node in range(placement.num_nodes):
        ranks = [a for a in placement.by_role("learner") if a.node == node]
        if not ranks:
            continue
        gpus = [g for a in ranks for g in a.gpus]
        first, last = ranks[0].rank, ranks[-1].rank
        name = f"learner-{first}" if first == last else f"learner-{first}..{last}"
        shares = sorted({a.num_gpus for a in ranks})
        rows.append(ActorPlacement(name, node, gpus, lr.num_cpus, f"rank{'s' if last > first else ''} "
                                   f"{first}{'-' + str(last) if last > first else ''} of {world}, ZeRO-{lr.zero_stage}",
                                   shares[-1], _ranges(gpus) if placement.gpu else "-"))
        if len(shares) > 1:
            rows[-1].detail += f" (GPU {shares[0]:g} where an engine shares it)"
    engines = [ActorPlacement(a.name, a.node, list(a.gpus), a.num_cpus, detail["generator"], a.num_gpus, bundles(a))
               for a in placement.by_role("generator")]
    rest = [ActorPlacement(a.name, a.node, [], a.num_cpus, detail[a.role], 0.0, bundles(a))
            for a in placement.actors if a.role not in ("generator", "learner")]
    return engines + rows + rest


def render_plan(plan) -> str:
    """A launch.plan.Plan as the text --dry-run prints (read by its fields: this module imports no plan)."""
    m = plan.model
    lines = [f"plan: {plan.recipe}  mode={plan.mode}  model={m.name} ({_count(plan.num_params)} params: "
             f"h={m.hidden_size} L={m.num_layers} heads={m.num_heads} kv_heads={m.num_kv_heads} "
             f"head_dim={m.head_dim} I={m.intermediate_size} V={m.vocab_size}"
             f"{' tied' if m.tie_word_embeddings else ''})"]
    if plan.total_gpus:
        lines.append(f"GPUs: {plan.total_gpus} ({plan.gpu_memory_gib:g} GiB each); "
                     f"learner world size {plan.learner_world_size}")
    else:
        lines.append(f"CPU only: {plan.cpu_requested:g} CPUs requested of {plan.cpu_available:g}")
    if plan.placement is not None:
        lines.append(f"weight sync: {plan.placement.weight_sync}")
        for node, row in enumerate(plan.placement.bundles):
            if row:
                lines.append(f"node {node}: placement group (STRICT_PACK) of {bundle_list(row)}")
    lines += ["", "placement:", f"  {'actor':<16} {'node':>4}  {'bundles':<9} {'gpus':<9} {'gpu':>4} {'cpus':>5}  detail"]
    for p in plan.placements:
        lines.append(f"  {p.actor:<16} {p.node:>4}  {p.bundle:<9} {_ranges(p.gpus) or '-':<9} {p.num_gpus:>4g} "
                     f"{p.num_cpus:>5g}  {p.detail}")
    for g in plan.gpu_memory:
        lines += ["", f"memory per GPU, GiB — {g.role} GPUs ({len(g.gpus)}: {_gpu_list(g.gpus)}):"]
        phases = list(g.phases)
        components = list(dict.fromkeys(c for p in phases for c in g.phases[p]))
        cw = max([30] + [len(c) + 1 for c in components])
        ws = [max(13, len(p) + 2) for p in phases]
        lines.append(f"  {'component':<{cw}}" + "".join(f"{p:>{w}}" for p, w in zip(phases, ws)))
        for c in components:
            lines.append(f"  {c:<{cw}}" + "".join(
                f"{g.phases[p][c]:>{w}.2f}" if c in g.phases[p] else f"{'-':>{w}}" for p, w in zip(phases, ws)))
        lines.append(f"  {'total':<{cw}}" + "".join(f"{g.phase_total(p):>{w}.2f}" for p, w in zip(phases, ws)))
        lines.append(f"  peak {g.peak_gib:.2f} GiB in {g.peak_phase} (limit {plan.gpu_memory_gib:g})")
    if plan.facts:
        lines += ["", "facts:"] + [f"  {k}: {_fmt(v)}" for k, v in plan.facts.items()]
    if plan.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in plan.notes]
    lines.append("")
    if plan.fits:
        lines.append("FITS")
    else:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {e}" for e in plan.errors]
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


def bundle_list(row: list[dict[str, float]]) -> str:
    """[{GPU 1, CPU 2} x8, {CPU 1}] as "8 x {GPU: 1, CPU: 2} + {CPU: 1}"."""
    groups: list[list] = []
    for b in row:
        if groups and groups[-1][0] == b:
            groups[-1][1] += 1
        else:
            groups.append([b, 1])
    text = ["{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}" for b, _ in groups]
    return " + ".join(f"{n} x {t}" if n > 1 else t for t, (_, n) in zip(text, groups))


def _gpu_list(gpus: list[tuple[int, int]]) -> str:
    by_node: dict[int, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    return " ".join(f"node{n}:{_ranges(sorted(g))}" for n, g in sorted(by_node.items()))
