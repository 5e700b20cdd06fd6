"""FlexAttention for packed rows, shared prompts included ("prefix_flex", registered with transformers).

The mask is policies/packing.py's one rule: query q sees key k iff same segment, k <= q, and
branch[k] is 0 or branch[q]. It covers the unshared block-causal rows (all branches 0) and the
shared-prompt rows of policies/prefix.py, which flash / varlen cannot express.

Invariants:
- The BlockMask is built once per packed micro-batch and device (`block_mask_for`, cached on the
  PackedBatch) and reused by every layer, the old-log-prob pass, every update epoch and backward.
  It reaches the attention function as the model's `attention_mask`: transformers returns a 4D
  mask or BlockMask unchanged (masking_utils, 5.17 and 5.24), so no mask function is registered.
- The block mask is computed exactly at tile level from the id tensors (`block_tiles`, chunked,
  no compile); flex_attention is torch.compile'd once per process on CUDA (Triton kernels;
  automatic dynamic shapes, so new row lengths do not recompile each time). Off CUDA it
  runs eagerly (a dense reference, forward only: torch has no flex backward on CPU), for tests of the
  mask and the plumbing; the learner never picks flex off CUDA.
- GQA is native (`enable_gqa`); no dropout, no sliding window (refused in one line).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from policies.packing import FLEX, PackedBatch

BLOCK = 128  # flex's default sparse block: rows are padded to a multiple of it on CUDA


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    from torch.nn.attention import flex_attention as fa

    fn = getattr(fa, name)
    return torch.compile(fn)


def _mask_mod(segment_ids: torch.Tensor, branch_ids: torch.Tensor):
    seg, br = segment_ids.reshape(-1), branch_ids.reshape(-1)

    def mask_mod(b, h, q, k):
        return (seg[q] == seg[k]) & (k <= q) & ((br[k] == 0) | (br[k] == br[q]))
    return mask_mod


def block_tiles(segment_ids: torch.Tensor, branch_ids: torch.Tensor, block: int = BLOCK,
                chunk_rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) [nq, nk] bool: per (query block, key block) tile, whether some / every position pair
    may attend (packing's rule). Exact, on the ids' device, in chunks of query rows (no [T, T] at once);
    positions past T count as masked for `any` and as not allowed for `all` (a ragged tile is partial)."""
    seg, br = segment_ids.reshape(-1), branch_ids.reshape(-1)
    t = seg.numel()
    nb = -(-t // block)
    pad = nb * block - t
    dev = seg.device
    if pad:  # out-of-range keys: a segment no query has; out-of-range queries: dropped from `all` below
        seg = torch.cat([seg, torch.full((pad,), -2, dtype=seg.dtype, device=dev)])
        br = torch.cat([br, torch.zeros(pad, dtype=br.dtype, device=dev)])
    k = torch.arange(nb * block, device=dev)
    any_t = torch.zeros(nb, nb, dtype=torch.bool, device=dev)
    all_t = torch.zeros(nb, nb, dtype=torch.bool, device=dev)
    step = max(block, chunk_rows - chunk_rows % block)
    for q0 in range(0, nb * block, step):
        q = torch.arange(q0, min(q0 + step, nb * block), device=dev)
        sq, bq = seg[q][:, None], br[q][:, None]
        ok = (sq == seg[None, :]) & (k[None, :] <= q[:, None]) & ((br[None, :] == 0) | (br[None, :] == bq))
        ok &= (seg[None, :] != -2) & (sq != -2)
        tiles = ok.reshape(len(q) // block, block, nb, block)
        any_t[q0 // block: q0 // block + len(q) // block] = tiles.any(dim=(1, 3))
        all_t[q0 // block: q0 // block + len(q) // block] = tiles.all(dim=(1, 3))
    return any_t, all_t


def build_block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor):
    """The BlockMask of one row ([T] or [1, T] id tensors, on the device attention runs on), from
    `block_tiles`: full tiles skip the mask function, partial ones apply it, the rest are skipped.
    No torch.compile (a compiled create_block_mask hung in Triton's LLVM pass on the H200 for some
    row lengths, docs/perf/h200.md)."""
    from torch.nn.attention.flex_attention import BlockMask

    t = segment_ids.numel()
    any_t, all_t = block_tiles(segment_ids, branch_ids)
    partial = any_t & ~all_t

    def blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # selected first, in order
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(all_t)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK,
                                    _mask_mod(segment_ids, branch_ids), (t, t))


def block_mask_for(mb: PackedBatch):
    """The row's BlockMask, built on first use and cached on the PackedBatch (module doc)."""
    key = ("flex", str(mb.segment_ids.device))
    if key not in mb.attn_cache:
        mb.attn_cache[key] = build_block_mask(mb.segment_ids, mb.branch_ids)
    return mb.attn_cache[key]


def flex_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, **kwargs: Any):
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise ValueError(f"{FLEX} attention needs the row's BlockMask as attention_mask (actors/attention_flex."
                         f"block_mask_for), got {type(attention_mask).__name__}")
    if dropout:
        raise NotImplementedError(f"{FLEX} attention: attention dropout is not supported")
    if sliding_window is not None:
        raise NotImplementedError(f"{FLEX} attention: sliding-window layers are not supported")
    fn = _compiled("flex_attention") if query.is_cuda else flex_attention
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers "prefix_flex" with transformers' AttentionInterface (idempotent). Returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX, flex_attention_forward)
    return FLEX
