"""Packed-row attention for the learner: causal attention inside each sample of one packed row.

A packed micro-batch is one row [1, T] holding whole samples back to back (policies/packing.py).
Attention must not cross sample boundaries. With learner.share_prompt (the default) a row holds each
group's prompt once and its responses after it (policies/prefix.py): only "prefix_flex"
(actors/learner/attention_flex.py, CUDA) and the dense mask below express that, and
`select_attn_implementation` picks them. Without it, the implementations in order of preference:

- flash_attention_2/3 (transformers' own, needs the flash_attn package): varlen from position_ids.
- "varlen" (this module): torch's `torch.nn.attention.varlen.varlen_attn` (torch >= 2.11, a Flash
  kernel, CUDA only) over the row, cut by the PackedBatch's cu_seqlens, which the learner passes
  to the model as `cu_seq_lens_q` / `max_length_q` (transformers forwards them to the attention
  function); without them they are derived from the restarting position ids. GQA is native, no
  [T, T] mask is ever built. Registered with transformers' AttentionInterface under "varlen".
- "segments" (actors/learner/attention_segments.py): one sdpa per attention segment of the row; the CPU path,
  shared prompts included.
- sdpa / eager with the block-diagonal [1, 1, T, T] additive mask (PackedBatch.attention_mask):
  the fallback. It is exact but computes all T^2 scores of the row (on an H200
  at 32k tokens: 3.5x slower than varlen and 87 GiB, measured 2026-12-02: `git show 0c0094e:docs/perf/h200.md`).

Off CUDA, or where varlen_attn is missing, the "varlen" function runs one sdpa(is_causal) per
sample instead (same contract, slower): that is what lets the CPU tests run the registered
function, its kwargs plumbing and the cu_seqlens from the packing, end to end.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from policies.packing import (  # noqa: F401
    FLASH_ATTENTION_IMPLS,
    FLEX,
    SEGMENTS,
    VARLEN,
    expresses_shared_prefix,
    needs_dense_mask,  # (re-exported)
)


def torch_varlen_available() -> bool:
    """torch ships varlen_attn (2.11+). It has CUDA kernels only (checked: torch 2.13 CPU raises)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_attn_implementation(requested: str, device: torch.device | str, share_prompt: bool = False) -> str:
    """The attention implementation the learner builds its model with.

    Off CUDA, "sdpa" and "auto" become "segments" (actors/learner/attention_segments.py: one sdpa per attention
    segment, shared prompts included), whatever `share_prompt`.
    With `share_prompt` (learner.share_prompt: rows whose responses share a prompt, policies/prefix.py):
    "sdpa" / "auto" become "prefix_flex" (actors/learner/attention_flex.py) on CUDA;
    flash / "varlen" cannot express the mask: a ValueError naming the field.
    Without it:

    - "varlen": always honoured (on CPU it runs the per-sample sdpa loop; see the module doc).
    - "sdpa" or "auto" on CUDA without flash_attn, where torch has varlen_attn: "varlen", because
      sdpa over a packed row needs the dense block-diagonal mask.
    - "auto" on CUDA with flash_attn installed: "flash_attention_2".
    - Anything else: unchanged ("eager" keeps the dense block-diagonal mask).
    """
    dev = torch.device(device)
    if dev.type != "cuda" and requested in ("sdpa", "auto"):
        return SEGMENTS
    if share_prompt:
        if not expresses_shared_prefix(requested):
            raise ValueError(f"model.attn_implementation={requested!r} cannot express learner.share_prompt's mask "
                             f"(responses sharing a prompt); use sdpa or auto (flex on CUDA, the dense mask on CPU), "
                             f"or learner.share_prompt=false")
        if requested in ("sdpa", "auto"):
            from actors.learner.attention_flex import flex_available

            return FLEX if dev.type == "cuda" and flex_available() else "sdpa"
        return requested
    if requested == VARLEN:
        return VARLEN
    if requested not in ("sdpa", "auto"):
        return requested
    if dev.type == "cuda":
        if requested == "auto" and flash_attn_installed():
            return "flash_attention_2"
        if not flash_attn_installed() and torch_varlen_available():
            return VARLEN
    return "sdpa"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [S + 1] on the ids' device, longest segment) from ids restarting at 0.

    Every position where the id is 0 starts a segment; trailing padding (ids restarting at 0 too)
    is a segment of its own. One device->host copy: use the PackedBatch's cu_seqlens when there.
    """
    pos = position_ids.reshape(-1)
    t = pos.numel()
    starts = (pos == 0).nonzero().reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype, device=starts.device), starts])
    cu = torch.cat([starts, torch.full((1,), t, dtype=starts.dtype, device=starts.device)]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if t else 0
    return cu, max_len


def _per_sample_sdpa(q, k, v, cu: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D], one sdpa(is_causal) per segment."""
    import torch.nn.functional as F

    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0)


@functools.lru_cache(maxsize=None)
def varlen_call_style(parameters: tuple[str, ...]) -> tuple[str, bool]:
    """How this torch's `varlen_attn` takes causality and GQA, from its parameter names.

    torch 2.11 (the H200 image) has neither `window_size` nor `enable_gqa`: causal is `is_causal`
    and grouped K/V heads are repeated here; torch 2.13 takes `window_size=(-1, 0)` and
    `enable_gqa`. Returns (causal keyword, whether GQA is native).
    """
    if "is_causal" in parameters:
        causal = "is_causal"
    elif "window_size" in parameters:
        causal = "window_size"
    else:
        raise RuntimeError(f"torch's varlen_attn takes neither is_causal nor window_size: {parameters}")
    return causal, "enable_gqa" in parameters


def _torch_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    causal, native_gqa = varlen_call_style(tuple(inspect.signature(varlen_attn).parameters))
    kw: dict[str, Any] = {"scale": scale, **({"is_causal": True} if causal == "is_causal" else {"window_size": (-1, 0)})}
    if q.shape[1] != k.shape[1]:
        if native_gqa:
            kw["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def check_packed_call(name: str, query: torch.Tensor, dropout: float, sliding_window: int | None) -> None:
    """What the packed-row attention functions (varlen, segments) refuse: a batch of rows, dropout, sliding windows."""
    if query.shape[0] != 1:
        raise ValueError(f"{name} attention takes one packed row, got batch {query.shape[0]}")
    if dropout:
        raise NotImplementedError(f"{name} attention: attention dropout is not supported")
    if sliding_window is not None:
        raise NotImplementedError(f"{name} attention: sliding-window layers are not supported")


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs: Any):
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None).

    Causal within each segment given by `cu_seq_lens_q` (+ `max_length_q`), else by `position_ids`.
    """
    check_packed_call("varlen", query, dropout, sliding_window)
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None:
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError("varlen attention needs cu_seq_lens_q or position_ids")
        cu, max_len = cu_seqlens_from_position_ids(pos)
    t = query.shape[2]
    cu = cu.to(device=query.device, dtype=torch.int32)
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max())
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if query.is_cuda and torch_varlen_available():
        out = _torch_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, int(max_len), scaling)
    else:
        out = _per_sample_sdpa(q, k, v, cu, scaling)
    if out.shape[0] != t:
        raise ValueError(f"cu_seqlens cover {out.shape[0]} of the row's {t} positions")
    return out.unsqueeze(0), None


def register() -> str:
    """Registers "varlen" with transformers' AttentionInterface (idempotent). Returns the name.

    No mask function is registered on purpose: for a name transformers has no mask function for,
    create_causal_mask returns None without looking at the position ids (no [T, T] work at all).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN
