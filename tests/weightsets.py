"""Weight sets for the weight-sync tests: mixed dtypes, awkward shapes and NaN payloads (bit-exactness), and
the bucket size that splits them into several buckets.

Invariant: pure (torch only); the same seed gives the same tensors.
"""
from __future__ import annotations

import torch

import weights as ws


def make_weights(seed: int, odd_shape: bool = False) -> dict[str, torch.Tensor]:
    """Mixed dtypes and awkward shapes, ~180 KB in all; NaN payloads check bit-exactness."""
    g = torch.Generator().manual_seed(seed)
    w = {
        "embed.weight": torch.randn(97, 64, generator=g),
        "layers.0.attn.q.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(64, generator=g).to(torch.float16),
        "layers.0.step": torch.tensor(7, dtype=torch.int64),  # 0-d
        "layers.0.empty": torch.zeros(0, 3),
        "layers.1.mlp.weight": torch.randn(64, 131, generator=g).t(),  # non-contiguous
        "layers.1.mask": torch.rand(13, 5, generator=g) > 0.5,
        "layers.1.ids": torch.randint(-(2**40), 2**40, (33,), generator=g, dtype=torch.int64),
        "lm_head.weight": torch.randn(97, 64, generator=g).to(torch.bfloat16),
    }
    w["embed.weight"][0, :3] = float("nan")
    w["embed.weight"][1, 0] = -0.0
    if odd_shape:
        w["layers.1.mlp.weight"] = torch.randn(131, 63, generator=g)
    return w


BUCKET_MB = 30_000 / ws.MB  # forces >= 3 buckets for make_weights
