"""Packed rows on CPU: one sdpa per attention segment instead of sdpa over the whole row under a [T, T] mask.

A packed row's attention never crosses segments (policies/packing.py: a sample, or with learner.share_prompt a
group's prompt with its responses). The dense [1, 1, T, T] mask makes sdpa compute all T^2 scores and discard
those across segments; on tiny's shared rows (~2,000 tokens of ~10 groups) that is ~10x the scores that count,
and it was most of a CPU training step. Here the row is cut into its segments (`PackedBatch.segment_blocks`)
and each runs as its own sdpa: causal alone (is_causal) for a plain sample, with its own [L, L] mask where it
has branches (a shared prompt's responses) or padding.

Invariants:
- The same attention as the dense mask, position for position (tests/integration/test_learner.py): each
  query's softmax runs over exactly the keys the mask allows; only scores the mask would have zeroed are skipped.
- The segments reach the attention function as the model kwarg `segment_blocks` (transformers hands model kwargs
  to every layer's attention function, as it does varlen's cu_seqlens); no mask is passed (`attention_mask` None).
- Registered with transformers' AttentionInterface under config.schema.SEGMENTS; no mask function is registered,
  so transformers builds no [T, T] mask for it either.
"""
from __future__ import annotations

from typing import Any

import torch

from actors.learner.attention import check_packed_call
from config.schema import SEGMENTS


def segments_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                               sliding_window: int | None = None, **kwargs: Any):
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    import torch.nn.functional as F

    blocks = kwargs.get("segment_blocks")
    if blocks is None:
        raise ValueError("segments attention needs the row's segment_blocks (PackedBatch.segment_blocks) as a model kwarg")
    check_packed_call(SEGMENTS, query, dropout, sliding_window)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for a, b, mask in blocks:
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        if mask is not None:
            mask = mask.to(device=query.device, dtype=query.dtype)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                                   enable_gqa=gqa))
    out = torch.cat(outs, dim=2)
    if out.shape[2] != query.shape[2]:
        raise ValueError(f"segment_blocks cover {out.shape[2]} of the row's {query.shape[2]} positions")
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers SEGMENTS with transformers' AttentionInterface (idempotent). Returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENTS, segments_attention_forward)
    return SEGMENTS
