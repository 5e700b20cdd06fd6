"""Token-budget packing: samples -> micro-batches -> minibatches -> one packed row per micro-batch.

Which samples share a micro-batch and which micro-batches a minibatch is policies/plan.py's (pure
Python, no torch: the assembler plans, the learner packs); its names are re-exported here.

Invariants:
- A packed row holds whole samples back to back, with position ids restarting at 0 for each
  sample, so a packed forward gives each sample exactly the log-probs it gets alone, provided
  attention does not cross sample boundaries:
    * flash_attention_2/3 (GPU): transformers derives the varlen boundaries from the restarting
      position_ids; no mask is passed (`PackedBatch.attention_mask` returns None).
    * "varlen" (actors/learner/attention.py; the learner's choice on a GPU without flash-attn): torch's
      varlen_attn over the row, cut by `PackedBatch.varlen_kwargs()` (cu_seqlens with trailing
      padding as a segment of its own, and the longest segment as a python int); no mask.
    * "segments" (actors/learner/attention_segments.py; the learner's choice on CPU): one sdpa per attention
      segment of the row (`PackedBatch.segment_blocks`: a sample, or a group's shared prompt with its
      responses), with that segment's own mask where it has branches: the scores a [T, T] mask would
      compute only to discard (all but the diagonal blocks) are never computed.
    * sdpa / eager (tests, or asked for by name): an explicit block-diagonal causal 4D mask is built and passed.
    * "prefix_flex" (actors/learner/attention_flex.py, CUDA): FlexAttention with a block mask built from
      `segment_ids` / `branch_ids`; it also expresses the shared-prompt rows of policies/prefix.py.
- The attention rule, one for every layout: query q may see key k iff `segment_ids` are equal,
  k <= q in row order, and `branch_ids[k]` is 0 or equal to `branch_ids[q]`. `pack` puts every
  sample in a segment of its own with branch 0 (block-causal); policies/prefix.py's shared rows use
  the branches. `block_causal_mask` is that rule as a dense mask.
- Everything is aligned to the *predicting* position: at position t the model's output scores
  `target_ids[t]`, the next token of the same sample. `completion_mask[t]` is True exactly when that
  target is a completion token, so prompt tokens, the last position of each sample and padding
  never reach the loss. `loss_mask` is `completion_mask` and the sample's own per-token loss mask
  (a multi-turn episode's observation tokens are 0): a completion position outside it is scored
  (`unpack` returns it) but contributes nothing to the loss, its token counts or its metrics.
  Without per-token masks the two are equal. Per-sample structure (`scatter`, `scatter_per_sample`,
  `unpack`, `completion_lengths`) follows `completion_mask`.
- A per-token mask whose length is not the sample's completion length is a ValueError naming the sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from config.schema import FLASH_ATTENTION_IMPLS, FLEX, SEGMENTS, VARLEN, expresses_shared_prefix  # noqa: F401 (re-exported)
from policies.plan import OversizedSampleWarning, padding_fraction, plan_micro_batches, split_minibatches  # noqa: F401 (re-exported)


def needs_dense_mask(attn_implementation: str) -> bool:
    """False for the implementations that keep samples apart themselves (no [T, T] mask)."""
    return attn_implementation not in FLASH_ATTENTION_IMPLS and attn_implementation not in (VARLEN, FLEX, SEGMENTS)


@dataclass
class PackedBatch:
    """One packed row. Every [1, T] tensor is aligned to the predicting position (see module doc).

    sample_index[0, t]: the sample position t belongs to (-1: padding, or a shared prompt trunk:
        such positions never carry loss, and every per-sample use of sample_index is under loss_mask).
    token_index[0, t]: index within its completion of the token scored at t (-1: none).
    segment_ids[0, t]: the attention segment (a sample, or one group part of a shared row; -1: padding).
    branch_ids[0, t]: 0 on a shared trunk or an unshared sample, r + 1 on response r of a shared part.
    cu_seqlens: segment boundaries; for `pack` these are the samples.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per sample
    target_ids: torch.Tensor  # [1, T] long, the next token of the same sample (0 where none)
    loss_mask: torch.Tensor  # [1, T] bool, True where target_ids[t] is a completion token the loss trains
    cu_seqlens: torch.Tensor  # [S + 1] int32, sample boundaries (padding not included)
    sample_index: torch.Tensor  # [1, T] long
    token_index: torch.Tensor  # [1, T] long
    completion_lengths: list[int]
    max_seqlen: int = 0  # longest segment of the row (a sample, or the trailing padding)
    num_padding: int = 0  # trailing padding positions (not in cu_seqlens)
    segment_ids: torch.Tensor | None = None  # [1, T] long; None: sample_index (unshared rows)
    branch_ids: torch.Tensor | None = None  # [1, T] long; None: all 0
    shared: bool = False  # some segment has branches (a shared prompt): flash / varlen cannot run it
    # [1, T] bool, True where target_ids[t] is a completion token (observations included); None: loss_mask
    completion_mask: torch.Tensor | None = None
    # Per-device attention inputs built once and reused by every forward (e.g. a flex block mask);
    # never copied by `to`.
    attn_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.segment_ids is None:
            self.segment_ids = self.sample_index
        if self.branch_ids is None:
            self.branch_ids = torch.zeros_like(self.sample_index)
        if self.completion_mask is None:
            self.completion_mask = self.loss_mask

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens in the row, observation tokens (loss mask 0) included."""
        return int(self.completion_mask.sum())

    @property
    def num_samples(self) -> int:
        return len(self.completion_lengths)

    def to(self, device: torch.device | str) -> "PackedBatch":
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()
                  if k != "attn_cache"}
        return PackedBatch(**fields)

    def scatter(self, per_sample: Sequence[torch.Tensor], fill: float = 0.0,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-completion-token values (one 1-D tensor per sample) -> a [1, T] tensor."""
        if len(per_sample) != self.num_samples:
            raise ValueError(f"got values for {len(per_sample)} samples, the batch packs {self.num_samples}")
        out = torch.full(self.input_ids.shape, fill, dtype=dtype, device=self.input_ids.device)
        rows = self.completion_mask[0].nonzero().squeeze(-1)
        for i, n in enumerate(self.completion_lengths):
            if len(per_sample[i]) != n:
                raise ValueError(f"sample {i}: {len(per_sample[i])} values for {n} completion tokens")
        if len(rows):
            flat = torch.cat([torch.as_tensor(v, dtype=dtype).reshape(-1) for v in per_sample]).to(out.device)
            out[0, rows] = flat  # completion positions are in sample order, tokens in order
        return out

    def scatter_per_sample(self, values: Sequence[float], fill: float = 0.0,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One scalar per sample (e.g. its advantage) broadcast over its completion tokens."""
        v = torch.tensor([*values, fill], dtype=dtype, device=self.input_ids.device)
        idx = torch.where(self.completion_mask, self.sample_index, torch.full_like(self.sample_index, len(values)))
        return v[idx]

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """A [1, T] (or [T]) per-position tensor -> one tensor per sample over its completion tokens."""
        flat = values.reshape(-1)[self.completion_mask.reshape(-1)]
        return list(torch.split(flat, self.completion_lengths))

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """What to pass as `attention_mask` so attention stays inside each sample (module doc)."""
        if not needs_dense_mask(attn_implementation):
            return None
        return block_causal_mask(self.segment_ids[0], dtype, self.branch_ids[0])

    def segment_blocks(self, dtype: torch.dtype = torch.float32) -> list[tuple[int, int, torch.Tensor | None]]:
        """The row cut into its attention segments: (start, end, mask) for each run of one segment id (a run of
        padding included), `mask` the run's own [1, 1, L, L] additive mask (`block_causal_mask` of the run) where
        the run has branches or padding, None where it is plain causal. Queries of one run see keys of that run
        only (the module's rule), so attention run by run is the whole row's attention. Built once per device
        and dtype (`attn_cache`)."""
        key = ("segments", dtype, self.input_ids.device)
        if key not in self.attn_cache:
            seg, br = self.segment_ids[0], self.branch_ids[0]
            cuts = ((seg[1:] != seg[:-1]).nonzero().reshape(-1) + 1).tolist()
            bounds = [0, *cuts, seg.shape[0]]
            blocks = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                plain = int(seg[a]) >= 0 and not bool((br[a:b] != 0).any())
                blocks.append((a, b, None if plain else block_causal_mask(seg[a:b], dtype, br[a:b])))
            self.attn_cache[key] = blocks
        return self.attn_cache[key]

    def varlen_cu_seqlens(self) -> torch.Tensor:
        """cu_seqlens covering the whole row: the samples, then trailing padding as one segment."""
        cu = self.cu_seqlens
        if self.num_padding:
            cu = torch.cat([cu, torch.tensor([self.num_tokens], dtype=cu.dtype).to(cu.device)])
        return cu

    def varlen_kwargs(self) -> dict:
        """Model kwargs for the "varlen" attention: transformers forwards them to the attention function."""
        if self.shared:
            raise ValueError("a shared-prompt row (learner.share_prompt) cannot run on varlen attention: "
                             "its responses share a segment; use flex or the dense mask")
        cu = self.varlen_cu_seqlens()
        m = self.max_seqlen or int((cu[1:] - cu[:-1]).max())
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32,
                      branch_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where query t may see key s, else min (the module's rule: same
    segment, s <= t, and branch[s] 0 or branch[t]; without `branch_ids` all branches are 0).

    Padding (segment -1) sees only itself; its outputs never reach the loss.
    """
    t = segment_ids.shape[0]
    seg = segment_ids.clone()
    pad = seg < 0
    # Give each padding position a segment of its own so its softmax row is never empty.
    seg[pad] = -1 - torch.arange(int(pad.sum()), device=seg.device)
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
    allowed = same & causal
    if branch_ids is not None:
        br = branch_ids.reshape(-1)
        allowed &= (br[None, :] == 0) | (br[None, :] == br[:, None])
    mask = torch.zeros(t, t, dtype=dtype, device=seg.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def token_loss_mask(mask, n: int, sample: int) -> torch.Tensor:
    """A sample's per-token loss mask (None: all ones) -> a bool tensor of its `n` completion tokens."""
    if mask is None:
        return torch.ones(n, dtype=torch.bool)
    m = torch.as_tensor(mask).reshape(-1)
    if m.numel() != n:
        raise ValueError(f"sample {sample}: loss mask has {m.numel()} entries for {n} completion tokens")
    return m.bool()


def pack(sequences: Sequence[tuple], pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """(prompt_ids, completion_ids) pairs, or (prompt_ids, completion_ids, loss_mask) triples, -> one
    packed row (see PackedBatch and the module doc). A loss mask holds one 0/1 (or bool) per completion
    token; None or a pair: all ones.

    Each prompt needs at least one token (it predicts the first completion token). With
    `pad_to_multiple_of` > 1 the row is padded at the end; padding is masked out of the loss.
    """
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ROW_FILL}
    cu = [0]
    comp_lens = []
    for i, (prompt, completion, *mask) in enumerate(sequences):
        p = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        c = torch.as_tensor(completion, dtype=torch.long).reshape(-1)
        if p.numel() == 0:
            raise ValueError(f"sample {i} has an empty prompt; at least one token must predict the completion")
        seq = torch.cat([p, c])
        n, np_, nc = seq.numel(), p.numel(), c.numel()
        m = torch.zeros(n, dtype=torch.bool)
        m[np_ - 1: np_ - 1 + nc] = True  # position t predicts token t + 1
        lm = torch.zeros(n, dtype=torch.bool)
        lm[np_ - 1: np_ - 1 + nc] = token_loss_mask(mask[0] if mask else None, nc, i)
        ti = torch.full((n,), -1, dtype=torch.long)
        ti[np_ - 1: np_ - 1 + nc] = torch.arange(nc)
        for k, v in (("input_ids", seq), ("position_ids", torch.arange(n)),
                     ("target_ids", torch.cat([seq[1:], torch.zeros(1, dtype=torch.long)])), ("loss_mask", lm),
                     ("completion_mask", m), ("sample_index", torch.full((n,), i, dtype=torch.long)),
                     ("token_index", ti)):
            cols[k].append(v)
        cu.append(cu[-1] + n)
        comp_lens.append(nc)
    return finish_row(cols, cu, comp_lens, pad_to_multiple_of, pad_token_id)


# Per-position columns of a packed row and the value trailing padding gets (position ids restart at 0).
ROW_FILL = {"input_ids": None, "position_ids": None, "target_ids": 0, "loss_mask": False, "completion_mask": False,
            "sample_index": -1, "token_index": -1, "segment_ids": -1, "branch_ids": 0}
_BOOL_COLUMNS = ("loss_mask", "completion_mask")


def finish_row(cols: dict[str, list[torch.Tensor]], cu: list[int], completion_lengths: list[int],
               pad_to_multiple_of: int = 1, pad_token_id: int = 0, shared: bool = False) -> PackedBatch:
    """Columns (lists of 1-D pieces in row order; segment/branch ids and completion_mask may be left empty) -> the
    PackedBatch, with trailing padding up to a multiple of `pad_to_multiple_of`."""
    total = cu[-1]
    pad = (-total) % max(1, pad_to_multiple_of)
    max_seqlen = max([b - a for a, b in zip(cu[:-1], cu[1:])] + [pad, 0])
    out: dict[str, torch.Tensor | None] = {}
    for k, fill in ROW_FILL.items():
        xs = cols.get(k) or []
        if not xs and k in ("segment_ids", "branch_ids", "completion_mask"):
            out[k] = None  # PackedBatch derives them (unshared rows; no per-token masks)
            continue
        dt = torch.bool if k in _BOOL_COLUMNS else torch.long
        if pad:
            xs = xs + [torch.arange(pad) if k == "position_ids" else
                       torch.full((pad,), pad_token_id if k == "input_ids" else fill, dtype=dt)]
        out[k] = (torch.cat(xs) if xs else torch.zeros(0, dtype=dt))[None]
    return PackedBatch(**out, cu_seqlens=torch.tensor(cu, dtype=torch.int32), completion_lengths=completion_lengths,
                       max_seqlen=max_seqlen, num_padding=pad, shared=shared)
