"""The torch dtype of a config's dtype name, in one place (the learner, the transformers engine).

Invariant: only the names the config types admit (model.dtype, learner.dtype) map; anything else is
a one-line ValueError naming the name, never a silent default.
"""
from __future__ import annotations

import torch

CONFIG_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in CONFIG_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(CONFIG_DTYPES)}")
    return CONFIG_DTYPES[name]
