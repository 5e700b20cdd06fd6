"""The learner's DeepSpeed engine over a transformers causal LM: built, stepped, exported, checkpointed.

Invariants:
- One engine per rank of the learner's torch.distributed world (a world of one: an in-process
  HashStore, no socket). DeepSpeed data parallel (ZeRO 0-3) averages gradients over the world; every
  group of it is bounded by `learner.collective_timeout_s` (actors/learner/world.py).
- The accumulation boundary is driven by the caller (`set_gradient_accumulation_boundary`), not
  by DeepSpeed's GAS: gradient_accumulation_steps is 1 and losses arrive already normalised.
- The lr is scheduled per training step here (LambdaLR on the torch optimizer), saved with the
  checkpoint together with the step and the world size that wrote it; a checkpoint of another
  world size is refused in one line naming both.
- `export_weights` yields HF-named tensors module by module; under ZeRO-3 it is collective (every
  rank must iterate it in lockstep) and never holds more than one module gathered at once.
- `sleep` frees accelerator memory between steps and `wake` restores it exactly (the weights stay).
- learner.lora (actors/lora.py): the model carries a peft adapter and only its parameters have gradients and
  are in the optimizer; `export_weights` yields the adapter's tensors under their PEFT names (the frozen base
  only once after a warm start trained it, actors/learner/lora_base.py), a checkpoint holds the adapter and its
  optimizer state without the frozen base, and `export_hf` writes a PEFT adapter directory naming the base.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator

import structlog
import torch

from actors import lora
from actors.dtypes import torch_dtype
from actors.learner import attention, attention_flex, attention_segments, weights_out
from actors.learner.logprob_head import (
    LogProbHead,
    apply_liger_kernels,
    limit_checkpointed_layers,
    restore_rotary_buffers,
)
from actors.learner.optimizer_offload import OptimizerStateOffload, offload_optimizer, reload_optimizer
from config import LearnerConfig, ModelConfig
from policies.packing import PackedBatch

log = structlog.get_logger("arctic_rl.learner")

WORLD_FILE = "learner_world.json"  # beside the DeepSpeed checkpoint: the world size that wrote it


def ensure_process_group(device: torch.device, timeout_s: float) -> None:
    """DeepSpeed needs a process group; a single process gets a world of one (gloo on CPU). A group
    made here (not already by actors/learner/world.py) is bounded by `timeout_s` as well."""
    import torch.distributed as dist

    from actors.learner.world import LOOPBACK, bind_gloo_to, init_bounded

    if dist.is_initialized():
        # DeepSpeed reads LOCAL_RANK; a world made before this Learner (init_world, or an earlier Learner
        # of this process) has one device per process, so 0 unless it was set.
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" not in os.environ or os.environ.get("WORLD_SIZE", "1") == "1":
        # A world of one rendezvous with nobody: an in-process store, so no TCPStore listens on
        # every interface and no MASTER_PORT inherited from a parent process can collide; its gloo
        # device binds loopback, not what the host name resolves to.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "gloo":
            bind_gloo_to(LOOPBACK)
        init_bounded(backend, timeout_s, store=dist.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("LOCAL_RANK", "0")
    init_bounded(backend, timeout_s)


def _skip_cpu_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (~30 s) on first init.

    deepspeed/comm/torch.py uses that op only in `inference_all_reduce` (tensor-parallel
    inference), never in training: ZeRO's gradient all-reduce / reduce-scatter and its gathers go
    through torch.distributed (gloo here). So it is marked incompatible for every world size
    (build_shm_op consults `deepspeed.ops.__compatible_ops__`) and never built.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base lr at training step s (one step per train_step)."""
    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    return f


# The attention implementations the learner registers with transformers: (register, why it was chosen).
REGISTERED_ATTENTION = {
    attention.VARLEN: (attention.register, "packed rows: varlen attention over cu_seqlens instead of sdpa's dense [T, T] mask"),
    attention.FLEX: (attention_flex.register, "learner.share_prompt: flex attention over segment and branch ids"),
    attention.SEGMENTS: (attention_segments.register,
                         "one sdpa per attention segment of a packed row, not one over a [T, T] mask"),
}


class LearnerEngine:
    """A rank's DeepSpeed engine and what it does besides training (see the module docstring)."""

    def __init__(self, learner_cfg: LearnerConfig, model_cfg: ModelConfig, model_path: str, total_steps: int,
                 micro_batch_tokens: int, temperature: float = 1.0):
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.cfg = learner_cfg
        self.model_cfg = model_cfg
        self.model_path = model_path
        self.total_steps = max(1, int(total_steps))
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.temperature = float(temperature) if temperature and temperature > 0 else 1.0
        dev = learner_cfg.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.dtype = torch_dtype(learner_cfg.dtype)
        self.attn_implementation = attention.select_attn_implementation(
            model_cfg.attn_implementation, self.device, share_prompt=learner_cfg.share_prompt)
        registered = REGISTERED_ATTENTION.get(self.attn_implementation)
        if registered is not None:
            registered[0]()
        # Rows padded to flex's block size on CUDA (at most 127 positions, never in the loss).
        self.pad_multiple = attention_flex.BLOCK if (self.attn_implementation == attention.FLEX
                                                     and self.device.type == "cuda") else 1
        if self.attn_implementation != model_cfg.attn_implementation:
            log.info("learner.attention", requested=model_cfg.attn_implementation, using=self.attn_implementation,
                     reason=registered[1] if registered is not None else "auto")
        self.use_liger = bool(learner_cfg.use_liger) and self.device.type == "cuda"
        if learner_cfg.use_liger and not self.use_liger:
            log.info("learner.logprob_path", path="torch", reason="use_liger needs a CUDA device; plain log_softmax on CPU")
        else:
            log.info("learner.logprob_path", path="liger-fused-linear-ce" if self.use_liger else "torch")

        ensure_process_group(self.device, learner_cfg.collective_timeout_s)
        _skip_cpu_shm_comm_build()
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.ds_config = self._ds_config()

        # ZeRO-3: transformers builds the model under zero.Init (partitioned while loading) as long
        # as this object is alive.
        # accelerate (a dependency) is what HfDeepSpeedConfig needs; without it each rank would load the
        # full model and deepspeed.initialize partition it: fine for small models, not for 32B on one host.
        self._hf_ds_config = None
        if learner_cfg.zero_stage == 3:
            try:
                from transformers.integrations import HfDeepSpeedConfig

                self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
            except ImportError as e:
                log.warning("learner.zero3_full_load", reason=str(e).splitlines()[0][:120])
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype,
                                                     attn_implementation=self.attn_implementation,
                                                     trust_remote_code=model_cfg.trust_remote_code)
        model.config.use_cache = False
        self.lora = lora.enabled(learner_cfg.lora)
        self.base_changed = False  # a LoRA warm start trained the base since the last export (lora_base.py)
        if self.lora:  # only the adapter trains, so only it reaches the optimizer below (actors/lora.py)
            lora.inject(model, learner_cfg.lora)
        self.liger_kernels = self.use_liger and learner_cfg.liger_kernels and apply_liger_kernels(model)
        if learner_cfg.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.checkpointed_layers = limit_checkpointed_layers(model, learner_cfg.checkpoint_layers)
        else:
            self.checkpointed_layers = 0
        model.train()  # Qwen3 has no dropout by default; train mode == eval mode numerically
        self.head = LogProbHead(model, self.temperature, self.use_liger)
        if learner_cfg.zero_stage == 3:
            deepspeed.zero.register_external_parameter(self.head, model.lm_head.weight)

        params = [p for p in self.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=learner_cfg.lr, betas=tuple(learner_cfg.betas),
                                      weight_decay=learner_cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.head, optimizer=optimizer,
                                                                 config=self.ds_config)
        # After zero.Init (which casts buffers made under it, e.g. RoPE inv_freq, to bf16) and after
        # DeepSpeed's own casts: the rotary buffers are recomputed in fp32 from the model config.
        restore_rotary_buffers(self.engine.module.model)
        self._offloaded: OptimizerStateOffload | None = None
        self._ds_offloaded = False
        warmup = int(math.ceil(learner_cfg.warmup_ratio * self.total_steps))
        # Scheduled per train_step here (not by DeepSpeed per micro-step); saved with the checkpoint.
        # On the torch optimizer itself: DeepSpeed's ZeRO wrappers share its param_groups.
        self.torch_optimizer = optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(learner_cfg.lr_schedule, warmup, self.total_steps))
        self.step = 0
        self.ref_model = self._build_ref_model() if learner_cfg.kl_coef > 0 else None
        self.asleep = False
        trainable = sum(p.numel() for p in params)
        log.info("learner.ready", trainable_params=trainable, lora_rank=learner_cfg.lora.rank if self.lora else 0,
                 zero_stage=learner_cfg.zero_stage, dtype=learner_cfg.dtype, device=str(self.device),
                 world_size=self.world_size, attn=self.attn_implementation, temperature=self.temperature)

    # ------------------------------------------------------------------ setup

    def _ds_config(self) -> dict[str, Any]:
        c = self.cfg
        zero: dict[str, Any] = {"stage": c.zero_stage}
        if c.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        ds: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            # The accumulation boundary is set per minibatch in train_step; losses arrive already
            # normalised by the minibatch's token count, so DeepSpeed must not rescale them.
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(c.grad_clip) if c.grad_clip > 0 else 0.0,
            "zero_optimization": zero,
            "steps_per_print": 10**12,
            "wall_clock_breakdown": False,
        }
        if c.dtype == "bfloat16":
            ds["bf16"] = {"enabled": True}
        return _deep_merge(ds, dict(c.ds_config))

    def _build_ref_model(self):
        """Frozen copy of the starting weights for the KL term (not sharded; fine up to a few B)."""
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                   attn_implementation=self.attn_implementation,
                                                   trust_remote_code=self.model_cfg.trust_remote_code)
        ref.config.use_cache = False
        ref.requires_grad_(False)
        restore_rotary_buffers(ref)
        return LogProbHead(ref, self.temperature, self.use_liger).to(self.device).eval()

    # ------------------------------------------------------------------ forward and step

    def _forward(self, mb: PackedBatch, module=None, with_entropy: bool = False, temperature: float | None = None):
        module = self.engine if module is None else module
        mask, extra = self._attention_inputs(mb)
        return module(mb.input_ids, mb.position_ids, mb.target_ids, attention_mask=mask,
                      with_entropy=with_entropy, temperature=temperature, **extra)

    def _attention_inputs(self, mb: PackedBatch) -> tuple[Any, dict[str, Any]]:
        """(attention_mask, extra model kwargs) for one packed row under this learner's attention."""
        impl = self.attn_implementation
        if mb.shared and not attention.expresses_shared_prefix(impl):
            raise ValueError(f"a shared-prompt row cannot run on {impl!r} attention (learner.share_prompt needs "
                             f"flex or the dense mask)")
        if impl == attention.FLEX:
            return attention_flex.block_mask_for(mb), {}
        if impl == attention.VARLEN:
            return None, mb.varlen_kwargs()
        if impl == attention.SEGMENTS:
            return None, {"segment_blocks": mb.segment_blocks(self.dtype)}
        return mb.attention_mask(impl, self.dtype), {}

    def _optimizer_step(self) -> float:
        """engine.step() at the accumulation boundary; returns the pre-clip global grad norm."""
        own = None
        if type(self.engine.optimizer) is torch.optim.AdamW:
            # Unwrapped optimizer (ZeRO 0, fp32): DeepSpeed clips but does not report the norm.
            # Gradients are already all-reduced at the boundary, so this norm is global.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            own = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self.engine.step()
        gn = self.engine.get_global_grad_norm() if own is None else own
        if isinstance(gn, torch.Tensor):
            gn = gn.item()
        return float(gn) if gn is not None else float("nan")

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self, bucket_mb: float = 512, device: str = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named tensors in buckets of about `bucket_mb` (actors/learner/weights_out.py)."""
        return weights_out.export_buckets(self, bucket_mb, device)

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """All weights, HF-named, on CPU (small models and tests)."""
        return {n: t for bucket in self.export_weights(bucket_mb=1 << 20) for n, t in bucket}

    def save(self, path: str) -> str:
        """DeepSpeed checkpoint (model, optimizer) plus scheduler and step. Returns the directory.
        Asleep (the coordinator checkpoints after learner.sleep()), the offloaded optimizer state is
        brought back for the save and offloaded again after: the checkpoint holds the real state."""
        if self.asleep:
            self.wake()
            try:
                return self.save(path)
            finally:
                self.sleep()
        os.makedirs(path, exist_ok=True)
        # Collective: each rank writes its own shard (ZeRO 1-3: its optimizer partition).
        # With LoRA the frozen base stays out (it is the model directory's): the adapter and its optimizer only.
        self.engine.save_checkpoint(path, tag="learner", client_state={
            "learner_step": self.step, "scheduler": self.scheduler.state_dict(), "world_size": self.world_size},
            exclude_frozen_parameters=self.lora)
        if self.rank == 0:
            with open(os.path.join(path, WORLD_FILE), "w") as f:
                json.dump({"world_size": self.world_size, "zero_stage": self.cfg.zero_stage}, f)
        return path

    def load(self, path: str) -> int:
        """Restores what `save` wrote; returns the training step it resumes at. A checkpoint of
        another world size is refused in one line naming both (no universal-checkpoint conversion).
        Asleep, the optimizer state comes back to the device for the load and goes to the host again
        after, as in `save`: the loaded state is what the next wake brings back."""
        if self.asleep:  # the launcher puts a learner to sleep before engines start on its GPU: load awake
            self.wake()
            try:
                return self.load(path)
            finally:
                self.sleep()
        marker = os.path.join(path, WORLD_FILE)
        saved = json.load(open(marker))["world_size"] if os.path.exists(marker) else 1
        if saved != self.world_size:
            raise ValueError(f"learner checkpoint {path} was saved by {saved} learner rank(s); this run has "
                             f"learner.num_ranks={self.world_size}: resume with learner.num_ranks={saved}")
        load_path, client = self.engine.load_checkpoint(path, tag="learner", load_optimizer_states=True,
                                                        load_lr_scheduler_states=False,
                                                        load_module_strict=not self.lora)
        if load_path is None:
            raise FileNotFoundError(f"no learner checkpoint under {path!r}")
        self.scheduler.load_state_dict(client["scheduler"])
        self.step = int(client["learner_step"])
        return self.step

    def export_hf(self, path: str) -> str:
        """save_pretrained of the current weights, or a PEFT adapter directory (actors/learner/weights_out.py)."""
        return weights_out.export_hf(self, path)

    # ------------------------------------------------------------------ colocation

    def sleep(self) -> None:
        """Frees accelerator memory between steps (the weights stay, for export and weight sync).

        With `offload_optimizer`: Adam moments and fp32 master weights go to the host; for ZeRO 1/2
        through DeepSpeed's `offload_states` (optimizer states, hp params, lp grads, grad buckets),
        for ZeRO-3 DeepSpeed offloads the grad buffers and the stage-3 hp params / Adam states are
        moved here (DeepSpeed's own needs its FusedAdam), for ZeRO-0 the torch optimizer's state
        and the fp32 masters are moved here. `wake` brings all of it back exactly.
        """
        if self.asleep:
            return
        if self.cfg.offload_optimizer:
            self._offloaded, self._ds_offloaded = offload_optimizer(self.engine, self.cfg.zero_stage,
                                                                    pin=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def memory(self) -> dict[str, float]:
        """This rank's device memory (actors/device_memory.py: GiB; the allocator's peaks since the last
        call); {} on CPU."""
        from actors.device_memory import memory_stats

        return memory_stats(self.device, reset_peak=True)

    def wake(self) -> None:
        if not self.asleep:
            return
        reload_optimizer(self.engine, self._offloaded, self._ds_offloaded)
        self._offloaded, self._ds_offloaded = None, False
        self.asleep = False


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
