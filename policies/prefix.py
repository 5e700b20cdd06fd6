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
- The plans (`plan_group_micro_batches`, `part_tokens`, `group_runs`) are policies/plan.py's, re-exported
  here; the learner rebuilds parts from the pairs (`group_runs`), so correctness never depends on the plan.
"""
from __future__ import annotations

from typing import Sequence

import torch

from policies.packing import ROW_FILL, PackedBatch, finish_row, token_loss_mask
from policies.plan import group_runs, part_tokens, plan_group_micro_batches  # noqa: F401 (re-exported)


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
