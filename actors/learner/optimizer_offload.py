"""Optimizer state off the accelerator between steps (colocation: the engines need that memory).

Invariants:
- Model parameters never move (the weights stay put for export and the next step); only optimizer
  state, fp32 master weights and gradient buffers leave, and each comes back to the device it
  came from, bit for bit.
- ZeRO 1/2 use DeepSpeed's own `offload_states`; ZeRO-0 and ZeRO-3 with a torch optimizer (which
  DeepSpeed cannot offload) are moved here by `OptimizerStateOffload`.
- Each rank offloads its own shard; nothing here communicates.
"""
from __future__ import annotations

import time
from typing import Sequence

import structlog
import torch

log = structlog.get_logger("arctic_rl.learner")


class OptimizerStateOffload:
    """Moves a torch optimizer's state tensors and its non-model params (fp32 masters) to the host and back.

    For the optimizers DeepSpeed cannot offload itself: the unwrapped torch AdamW (ZeRO-0, fp32),
    FP16_UnfusedOptimizer (ZeRO-0, bf16: fp32 master copies + Adam moments) and ZeRO-3 with torch
    AdamW (DeepSpeed's stage-3 offload of optimizer states / hp params needs its FusedAdam). Model
    parameters are never touched (the weights stay put for export and the next step). Every tensor
    goes back to the device it came from (AdamW's `step` counters live on the host already). Each
    offload copies, so even on a CPU-only run the state really leaves its storage and comes back.

    `masters` are fp32 master tensors the optimizer holds outside its param_groups between steps:
    DeepSpeed's stage 3 empties the inner optimizer's param_groups after building its fp32
    partitions (deepspeed/runtime/zero/stage3.py `_create_fp32_partitions`: `param_group['params'] = []`)
    and puts `fp32_partitioned_groups_flat[i]` there only for the duration of each sub-group's step
    (`_optimizer_step`), so at ZeRO-3 the masters are reachable only through that list. A master that
    shares its storage with a model parameter (no separate fp32 copy) is the weights and stays.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model_params: Sequence[torch.nn.Parameter],
                 masters: Sequence[torch.Tensor] = ()):
        self.optimizer = optimizer
        self.skip = {id(p) for p in model_params}
        weights = {p.untyped_storage().data_ptr() for p in model_params}
        weights |= {p.ds_tensor.untyped_storage().data_ptr() for p in model_params if hasattr(p, "ds_tensor")}
        in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.masters = [t for t in masters if t.numel() and id(t) not in in_groups
                        and t.untyped_storage().data_ptr() not in weights]
        self.params: list[tuple[torch.Tensor, torch.device]] = []
        self.state: list[tuple[dict, str, torch.device]] = []

    def offload(self, pin: bool) -> int:
        """Returns the bytes moved off the accelerator."""
        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            out.copy_(t)
            return out

        moved = 0
        for group in self.optimizer.param_groups + [{"params": self.masters}]:
            for p in group["params"]:
                if id(p) in self.skip:
                    continue
                self.params.append((p, p.device))
                for t in (p, p.grad):
                    if t is not None and t.device.type != "cpu":
                        moved += t.numel() * t.element_size()
                g = None if p.grad is None else host(p.grad)
                p.grad = None  # a grad must sit on its param's device: swap both
                p.data = host(p.data)
                p.grad = g
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    self.state.append((st, k, v.device))
                    moved += v.numel() * v.element_size() if v.device.type != "cpu" else 0
                    st[k] = host(v)
        return moved

    def reload(self) -> None:
        for p, dev in self.params:
            g = p.grad
            p.grad = None
            p.data = p.data.to(dev, copy=True)
            p.grad = None if g is None else g.to(dev, copy=True)
        for st, k, dev in self.state:
            st[k] = st[k].to(dev, copy=True)
        self.params, self.state = [], []


def offload_optimizer(engine, zero_stage: int, pin: bool) -> tuple[OptimizerStateOffload | None, bool]:
    """Moves the DeepSpeed engine's optimizer state to the host. Returns (what this module moved, or
    None; whether DeepSpeed's `offload_states` moved some): `reload_optimizer` takes both back."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    opt = engine.optimizer
    t0 = time.perf_counter()
    moved = 0
    ds_offloaded = False
    offloaded = None
    if zero_stage in (1, 2) and hasattr(opt, "offload_states"):
        engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer],
                              pin_memory=pin)
        ds_offloaded = True
        how = "deepspeed"
    else:
        if zero_stage == 3 and hasattr(opt, "offload_states"):
            engine.offload_states(include=[S.lp_grads, S.contiguous_grad_buffer], pin_memory=pin)
            ds_offloaded = True
        inner = opt if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer") else opt.optimizer
        # ZeRO-3's fp32 masters sit outside the inner optimizer's param_groups between steps.
        masters = getattr(opt, "fp32_partitioned_groups_flat", []) if zero_stage == 3 else []
        offloaded = OptimizerStateOffload(inner, list(engine.module.parameters()), masters)
        moved = offloaded.offload(pin)
        how = "deepspeed+learner" if ds_offloaded else "learner"
    log.info("learner.offload_optimizer", zero_stage=zero_stage, via=how, gib=round(moved / 2**30, 3),
             s=round(time.perf_counter() - t0, 3))
    return offloaded, ds_offloaded


def reload_optimizer(engine, offloaded: OptimizerStateOffload | None, ds_offloaded: bool) -> None:
    """Brings back what `offload_optimizer` moved."""
    if ds_offloaded:
        engine.reload_states()
    if offloaded is not None:
        offloaded.reload()
