"""Micro-batch and minibatch plans: which samples share a packed row, which rows an optimizer step.

Pure Python on token counts (no torch): the assembler plans a step's batch with these, the learner
packs the rows (policies/packing.py `pack`, policies/prefix.py `pack_shared`), which re-export them.

Invariants:
- Every sample index appears in exactly one micro-batch; a sample longer than the budget gets a
  micro-batch of its own and an OversizedSampleWarning (it is never dropped or truncated).
- `plan_group_micro_batches` packs groups as units under the token budget, each group part costing
  `part_tokens` (its prompt once, the prompt's last token once per response); a group too large for
  one micro-batch splits into parts that each carry the prompt once. Every (group, sample) pair is in
  exactly one micro-batch; within one, a group's samples are contiguous and ascending (`group_runs`
  reads them back).
- `split_minibatches` never makes an empty minibatch; every plan is deterministic.
"""
from __future__ import annotations

import heapq
import warnings
from typing import Sequence


class OversizedSampleWarning(UserWarning):
    """A sample longer than the micro-batch token budget: it is trained alone."""


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sample indices per micro-batch, each micro-batch's total length <= max_tokens.

    First-fit-decreasing over the sample lengths (prompt + completion tokens). A sample longer
    than `max_tokens` gets its own micro-batch and an OversizedSampleWarning. Indices within a
    micro-batch are ascending; micro-batches come longest-first. Deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    oversized = []
    for i in order:
        n = int(lengths[i])
        if n < 0:
            raise ValueError(f"sample {i} has negative length {n}")
        if n > max_tokens:
            oversized.append(i)
            bins.append([i])
            free.append(0)
            continue
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max_tokens - n)
    if oversized:
        warnings.warn(f"{len(oversized)} sample(s) longer than the micro-batch budget of {max_tokens} tokens "
                      f"(longest {max(lengths[i] for i in oversized)}): each trained in a micro-batch of its own",
                      OversizedSampleWarning, stacklevel=2)
    return [sorted(b) for b in bins]


def split_minibatches(micro_batches: Sequence[Sequence[int]], num_minibatches: int,
                      lengths: Sequence[int] | None = None, tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Micro-batch indices per minibatch (one optimizer step each), balanced by tokens.

    With `tokens` (per micro-batch: what its packed row holds, e.g. a shared prompt counted once) or
    `lengths` (per sample, as given to plan_micro_batches) the minibatches are balanced by token
    count, else by sample count (longest-processing-time greedy). When there are fewer
    micro-batches than `num_minibatches`, every micro-batch becomes its own minibatch: fewer
    optimizer steps, never an empty one. Indices within a minibatch are ascending.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    if tokens is not None and len(tokens) != len(micro_batches):
        raise ValueError(f"tokens has {len(tokens)} entries for {len(micro_batches)} micro-batches")
    weight = (list(tokens) if tokens is not None else
              [sum(lengths[i] for i in mb) if lengths is not None else len(mb) for mb in micro_batches])
    k = min(num_minibatches, len(micro_batches))
    heap = [(0, m) for m in range(k)]
    out: list[list[int]] = [[] for _ in range(k)]
    for j in sorted(range(len(micro_batches)), key=lambda j: (-weight[j], j)):
        load, m = heapq.heappop(heap)
        out[m].append(j)
        heapq.heappush(heap, (load + weight[j], m))
    return [sorted(mb) for mb in out]


def padding_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], max_tokens: int) -> float:
    """Share of the padded slots when every micro-batch is padded to `max_tokens` (the budget)."""
    used = sum(lengths[i] for mb in micro_batches for i in mb)
    slots = sum(max(max_tokens, sum(lengths[i] for i in mb)) for mb in micro_batches)
    return 1.0 - used / slots if slots else 0.0


def part_tokens(prompt_len: int, completion_lens: Sequence[int]) -> int:
    """Tokens of one group part in a shared row (prompt once, its last token once per response)."""
    if not completion_lens:
        return 0
    return int(prompt_len) - 1 + sum(1 + int(m) for m in completion_lens)


def group_runs(pairs: Sequence[tuple[int, int]], field: str = "micro_batch") -> list[tuple[int, list[int]]]:
    """(group, sample) pairs -> runs of consecutive pairs of one group: [(group, [samples])].

    A group listed in two runs (its samples not contiguous) is a ValueError naming `field`.
    """
    runs: list[tuple[int, list[int]]] = []
    seen: set[int] = set()
    for g, s in pairs:
        if runs and runs[-1][0] == g:
            runs[-1][1].append(s)
            continue
        if g in seen:
            raise ValueError(f"{field}: the samples of group {g} are not contiguous (learner.share_prompt packs "
                             f"each group's consecutive samples under one prompt)")
        seen.add(g)
        runs.append((g, [s]))
    return runs


def _split_group(prompt_len: int, comp: Sequence[int], samples: list[int], max_tokens: int) -> list[list[int]]:
    """One group's samples -> parts that each fit the budget with the prompt once (first-fit
    decreasing; a sample too long even alone gets a part of its own)."""
    if part_tokens(prompt_len, [comp[s] for s in samples]) <= max_tokens:
        return [sorted(samples)]
    parts: list[list[int]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: (-comp[s], s)):
        cost = 1 + int(comp[s])
        for j, free in enumerate(room):
            if cost <= free:
                parts[j].append(s)
                room[j] -= cost
                break
        else:
            parts.append([s])
            room.append(max_tokens - (int(prompt_len) - 1) - cost)
    return [sorted(p) for p in parts]


def plan_group_micro_batches(prompt_lengths: Sequence[int], completion_lengths: Sequence[Sequence[int]],
                             max_tokens: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Groups -> micro-batches of (group, sample) pairs and each one's shared-row token count.

    Groups are split into parts only when they exceed `max_tokens` (module doc), then the parts are
    packed first-fit-decreasing; a part placed beside another part of its group merges with it (the
    prompt is counted once). A part longer than the budget (a sample longer than it with its
    prompt) gets a micro-batch of its own and an OversizedSampleWarning. Micro-batches come
    longest-first; pairs within one are sorted. Deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(prompt_lengths) != len(completion_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(completion_lengths)} groups")
    items: list[tuple[int, list[int], int]] = []  # (group, samples, tokens)
    oversized = 0
    for g, (p, comp) in enumerate(zip(prompt_lengths, completion_lengths)):
        if int(p) < 1:
            raise ValueError(f"group {g} has prompt length {p}; at least one token must predict the completion")
        if any(int(m) < 0 for m in comp):
            raise ValueError(f"group {g} has a negative completion length")
        for part in _split_group(int(p), comp, list(range(len(comp))), max_tokens) if len(comp) else []:
            tokens = part_tokens(int(p), [comp[s] for s in part])
            oversized += tokens > max_tokens
            items.append((g, part, tokens))
    bins: list[dict[int, list[int]]] = []
    used: list[int] = []
    for g, part, tokens in sorted(items, key=lambda it: (-it[2], it[0], it[1])):
        extra = sum(1 + int(completion_lengths[g][s]) for s in part)  # beside a part of the same group
        for b, groups in enumerate(bins):
            cost = extra if g in groups else tokens
            if used[b] + cost <= max_tokens:
                groups.setdefault(g, []).extend(part)
                used[b] += cost
                break
        else:
            bins.append({g: list(part)})
            used.append(tokens)
    if oversized:
        warnings.warn(f"{oversized} group part(s) longer than the micro-batch budget of {max_tokens} tokens "
                      f"(a sample with its prompt): each trained in a micro-batch of its own",
                      OversizedSampleWarning, stacklevel=2)
    plans = [[(g, s) for g in sorted(groups) for s in sorted(groups[g])] for groups in bins]
    order = sorted(range(len(plans)), key=lambda b: (-used[b], plans[b]))
    return [plans[b] for b in order], [used[b] for b in order]
