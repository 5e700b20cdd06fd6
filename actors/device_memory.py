"""One process's view of its GPU's memory, in GiB: what the launcher logs at each start-up phase.

Invariants: every value is a float in GiB (2**30 bytes); off CUDA the answer is {} (nothing to report);
`device_used_gib` is the whole device's use (torch.cuda.mem_get_info: every process on the GPU, as
nvidia-smi counts it), the others this process's caching allocator (vLLM's sleep-mode pool included, it
allocates through torch). With `reset_peak` the allocator's peaks restart after being read, so each read
reports the peak since the previous one.
"""
from __future__ import annotations

from typing import Any

import torch


def memory_stats(device: Any, reset_peak: bool = False) -> dict[str, float]:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    out = {"allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
           "reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
           "max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
           "device_used_gib": (total - free) / 2**30}
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return out
