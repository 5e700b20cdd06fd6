"""The learner's frozen base under learner.lora: the tiny warm start that builds it, and where it goes after.

With LoRA the base is frozen for RL; the tiny recipe's warm start stands in for the pretraining a real base
had, so it trains the base itself (the same cross-entropy steps tiny's full warm start takes, the adapter
held out of them), never the adapter. A mixin of actors/learner/learner.py's Learner.

Invariants:
- A base step changes base parameters only (the adapter's B stays zero, so the model's output is the base's),
  with a plain AdamW of its own over fp32 masters of the base (the learner's betas and weight decay, `lr` as
  given, gradients summed over the ranks' shares and clipped at learner.grad_clip by DeepSpeed's own clip), held
  only until `save_base`: RL never holds base optimizer state, and DeepSpeed's optimizer never sees a base
  parameter. ZeRO-3 (a partitioned base) is refused by name.
- In fp32 (tiny, on CPU) a base step is bit for bit the step full fine-tuning's DeepSpeed engine takes on the
  same pairs (the adapter's B is zero, so its path adds exact zeros): tiny_lora's warm start is tiny's.
- After a base step, the next weight export carries the base's tensors (under their Hugging Face names) before
  the adapter's, once: the engines get the warm base in the first sync after the warm start, and only the
  adapter after that (`base_changed`, cleared when an export completes).
- `save_base(path)` writes the base as a Hugging Face model (config + weights; rank 0) into `path`, so an engine
  Ray restarts, a relaunched learner and every export's `base_model_name_or_path` find the base the adapter was
  trained over.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from actors.lora import base_hf_name

BASE_MARKER = "arl_warm_base.json"  # beside the weights save_base wrote: how many base steps made them


class LoraBase:
    _base_opt: Any = None
    _base_master: Any = None
    _base_steps: int = 0

    def _base_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        from actors import lora

        return [(n, p) for n, p in self.head.model.named_parameters() if lora.adapter_key(n) is None]

    def _base_sft_step(self, share: Sequence[dict], total: float, lr: float | None) -> float:
        """One AdamW step of the base on this rank's share (the adapter frozen meanwhile); returns the loss."""
        if self.cfg.zero_stage == 3:
            raise RuntimeError("learner.lora: the warm start trains the base, which ZeRO-3 partitions; "
                               "use learner.zero_stage <= 2 (or model.tiny_sft_steps=0)")
        base = [p for _, p in self._base_params()]
        adapter = [p for p in self.head.model.parameters() if p.requires_grad]
        if self._base_opt is None:  # fp32 masters of bf16 weights, as DeepSpeed's bf16 optimizer keeps them
            self._base_master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in base]
            self._base_opt = torch.optim.AdamW(self._base_master, lr=lr or self.cfg.lr, betas=tuple(self.cfg.betas),
                                               weight_decay=self.cfg.weight_decay)
        for g in self._base_opt.param_groups:
            g["lr"] = lr or self.cfg.lr
        for p in adapter:
            p.requires_grad_(False)
        for p in base:
            p.requires_grad_(True)
        loss_sum = 0.0
        try:
            for it in share:
                pb = it["packed"]
                lp, _ = self._forward(pb, module=self.head, temperature=1.0)
                loss = -(lp * pb.loss_mask).sum() / max(total, 1.0)
                (loss * it["weight"]).backward()
                loss_sum += float(loss.detach()) * it["weight"]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in base]
            if self.world_size > 1:
                import torch.distributed as dist

                for g in grads:
                    dist.all_reduce(g)
            for m, g in zip(self._base_master, grads):
                m.grad = g.float() if m.dtype != g.dtype else g
            if self.cfg.grad_clip > 0:  # DeepSpeed's own clip: in fp32 the step is then tiny's, bit for bit
                from deepspeed.runtime.utils import clip_grad_norm_

                clip_grad_norm_(self._base_master, self.cfg.grad_clip)
            self._base_opt.step()
            with torch.no_grad():
                for p, m in zip(base, self._base_master):
                    m.grad = None
                    if m is not p:
                        p.copy_(m)
        finally:
            for p in base:
                p.grad = None
                p.requires_grad_(False)
            for p in adapter:
                p.requires_grad_(True)
        self.base_changed = True
        self._base_steps += 1
        return float(self._reduce({"loss": loss_sum})["loss"])

    def save_base(self, path: str) -> str:
        """The base as a Hugging Face model in `path` (rank 0 writes; the base optimizer is dropped: the warm
        start is over). Every rank calls it."""
        import json

        self._base_opt = self._base_master = None
        if self.rank == 0:
            model = self.head.model
            state = {base_hf_name(n): p.detach().to("cpu", copy=True).contiguous() for n, p in self._base_params()}
            os.makedirs(path, exist_ok=True)
            model.save_pretrained(path, state_dict=state)
            with open(os.path.join(path, BASE_MARKER), "w") as f:
                json.dump({"base_steps": self._base_steps}, f)
        return path
