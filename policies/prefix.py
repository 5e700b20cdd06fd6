"""Shared-prompt packing: each part of a GRPO group holds its prompt once in a packed row.

Layout of one group part (prompt p of P tokens, responses c_1..c_n of m_1..m_n tokens):

    [p_0 .. p_{P-2}]                          trunk: positions 0..P-2, branch 0
    [p_{P-1}, c_r,0 .. c_r,m_r-1]  (r = 1..n)  response segment: positions P-1..P-1+m_r, branch r

Invariants:
- Everything policies/packing.py states for `pack` holds for `pack_shared`: position t predicts
  `target_ids[t]`, the next token of the same sample; `completion_mask[t]` is True exactly when that
  target is a completion token, `loss_mask[t]` when it is also in the sample's per-token loss mask;
  completion positions come in sample order, tokens in order, so `scatter`, `scatter_per_sample`,
  `unpack`, `completion_lengths` and `sample_index` (under `completion_mask`) mean what they mean for
  `pack`. Shared trunk positions have sample_index -1 and no loss.
- A multi-turn episode (its turns and the observations between them, masked out of the loss) is one
  response: its branch. The trunk is the group's prompt alone.
- The last prompt token is duplicated once per response: it predicts a different first token for
  each, and one position holds one target.
- Attention follows packing's one rule (segment, row order, branch): a response sees the trunk,
  its own copy of p_{P-1} and its own earlier tokens, at the positions it has alone, and never a
  sibling. Its log-probs are those of the unshared row up to float summation order; the trunk's
  activations receive the gradient of every response of the part in one graph.
- A part with one response is exactly `pack`'s layout (its branch is 0).
- A part costs P - 1 + sum(1 + m_r) tokens (`part_tokens`): the prompt once, not n times.
- `plan_group_micro_batches` packs groups as units under the token budget; a group too large for
  one micro-batch splits into parts that each carry the prompt once. Every (group, sample) pair is
  in exactly one micro-batch; within one, a group's samples are contiguous and ascending. The
  learner rebuilds parts from the pairs (`group_runs`), so correctness never depends on the plan.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from policies.packing import ROW_FILL, OversizedSampleWarning, PackedBatch, finish_row, token_loss_mask


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


def pack_shared(parts: Sequence[tuple], pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """(prompt_ids, [completion_ids, ...]) parts, or (prompt_ids, [completion_ids, ...], [loss_mask, ...])
    with one per-token mask (or None: all ones) per completion, -> one packed row (module doc's layout).

    Samples are numbered in order over the parts (sample_index, completion_lengths). Each prompt
    needs at least one token. Trailing padding as in `pack`; masks as in `pack`.
    """
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ROW_FILL}
    cu = [0]
    comp_lens: list[int] = []
    shared = False

    def put(ids, pos, tgt, loss, sample, segment, branch, token=None, trained=None):
        n = ids.numel()
        for k, v in (("input_ids", ids), ("position_ids", pos), ("target_ids", tgt), ("completion_mask", loss),
                     ("loss_mask", loss if trained is None else trained),
                     ("sample_index", torch.full((n,), sample, dtype=torch.long)),
                     ("token_index", torch.full((n,), -1, dtype=torch.long) if token is None else token),
                     ("segment_ids", torch.full((n,), segment, dtype=torch.long)),
                     ("branch_ids", torch.full((n,), branch, dtype=torch.long))):
            cols[k].append(v)

    for k, (prompt, completions, *masks) in enumerate(parts):
        p = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        if p.numel() == 0:
            raise ValueError(f"part {k} has an empty prompt; at least one token must predict the completion")
        if len(completions) == 0:
            raise ValueError(f"part {k} has no completions")
        masks = list(masks[0]) if masks and masks[0] is not None else [None] * len(completions)
        if len(masks) != len(completions):
            raise ValueError(f"part {k} has {len(masks)} loss masks for {len(completions)} completions")
        trunk = p.numel() - 1
        many = len(completions) > 1
        shared |= many
        if trunk:
            # A shared trunk belongs to no sample; a one-response part's prompt to its sample (as in pack).
            put(p[:-1], torch.arange(trunk), p[1:], torch.zeros(trunk, dtype=torch.bool),
                -1 if many else len(comp_lens), k, 0)
        length = trunk
        for r, completion in enumerate(completions):
            c = torch.as_tensor(completion, dtype=torch.long).reshape(-1)
            nc = c.numel()
            m = torch.zeros(nc + 1, dtype=torch.bool)
            m[:nc] = True
            lm = torch.zeros(nc + 1, dtype=torch.bool)
            lm[:nc] = token_loss_mask(masks[r], nc, len(comp_lens))
            ti = torch.full((nc + 1,), -1, dtype=torch.long)
            ti[:nc] = torch.arange(nc)
            put(torch.cat([p[-1:], c]), torch.arange(trunk, trunk + nc + 1), torch.cat([c, torch.zeros(1, dtype=torch.long)]),
                m, len(comp_lens), k, r + 1 if many else 0, token=ti, trained=lm)
            comp_lens.append(nc)
            length += nc + 1
        cu.append(cu[-1] + length)
    return finish_row(cols, cu, comp_lens, pad_to_multiple_of, pad_token_id, shared=shared)


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
