"""The learner: a DeepSpeed engine over a transformers causal LM, trained with GRPO on TrainBatches.

Invariants:
- Old log-probs are computed once per batch (no grad, same packing, same kernels as the update
  pass), before any optimizer step, so every update epoch clips against the same policy. The
  first update from the generator's own weights sees ratio 1, ppo_kl 0, clipfrac 0 exactly.
- Micro-batches are packed rows of whole samples under a token budget (policies/packing.py);
  nothing is padded to [B, max prompt + max response]. Attention never crosses samples.
- Gradient accumulation over a minibatch's micro-batches equals one big batch: each micro-batch
  loss is normalised by the minibatch's total valid tokens (or sequences), and the optimizer
  steps once per minibatch (the accumulation boundary is driven here, not by DeepSpeed's GAS).
- The learner divides logits by the sampler's temperature, so its log-probs and the sampler's
  are of the same distribution.
- Every returned metric is a python float (grad_norm included), reduced across ranks.

`Learner` is a plain class (importable and testable without Ray); `LearnerActor` at the bottom
is the thin Ray shell the coordinator talks to.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from typing import Any, Iterator, Sequence

import structlog
import torch

from actors import attention
from launch.config import LearnerConfig, ModelConfig
from policies.grpo import policy_loss
from policies.packing import PackedBatch, pack, plan_micro_batches
from queues.messages import TrainBatch, unpack_floats, unpack_ids

log = structlog.get_logger("arctic_rl.learner")

WORLD_FILE = "learner_world.json"  # beside the DeepSpeed checkpoint: the world size that wrote it
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ensure_process_group(device: torch.device) -> None:
    """DeepSpeed needs a process group; a single process gets a world of one (gloo on CPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" not in os.environ or os.environ.get("WORLD_SIZE", "1") == "1":
        # A world of one rendezvous with nobody: an in-process store, so no TCPStore listens on
        # every interface and no MASTER_PORT inherited from a parent process can collide.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend)


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


class _LogProbHead(torch.nn.Module):
    """Model + log-prob head in one module, so ZeRO-3 gathers lm_head inside a forward.

    Plain path: full logits / temperature -> log_softmax -> gather (and entropy when asked).
    Liger path (GPU): fused linear cross-entropy over hidden / temperature, full logits never
    materialised (lm_head has no bias in Qwen3, so (h / T) W^T == (h W^T) / T).
    """

    def __init__(self, model: torch.nn.Module, temperature: float, use_liger: bool):
        super().__init__()
        self.model = model
        self.temperature = float(temperature)
        self.flce = None
        if use_liger:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # GPU-only dependency

            self.flce = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def forward(self, input_ids, position_ids, target_ids, attention_mask=None, with_entropy: bool = False,
                temperature: float | None = None, **attn_kwargs):
        # attn_kwargs: cu_seq_lens_q/k, max_length_q/k for the "varlen" attention (actors/attention.py);
        # transformers hands them to the attention function of every layer.
        temp = self.temperature if temperature is None else temperature
        if self.flce is not None and not with_entropy:
            hidden = self.model.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                      use_cache=False, **attn_kwargs).last_hidden_state
            h = hidden.reshape(-1, hidden.shape[-1]) / temp
            lp = -self.flce(self.model.lm_head.weight, h, target_ids.reshape(-1))
            return lp.view(target_ids.shape).float(), None
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=False, **attn_kwargs).logits
        logits = logits.float() / temp
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
        return lp, entropy


def _rotary_reference(module: torch.nn.Module, buffer_name: str) -> torch.Tensor | None:
    """inv_freq as the rotary module's own init computes it from its config (fp32, on the CPU), or None.

    transformers' rotary modules keep `config` and `rope_type` and compute inv_freq with
    `compute_default_rope_parameters` ("default") or `ROPE_INIT_FUNCTIONS[rope_type]`; a buffer
    named "<layer_type>_inv_freq" belongs to a per-layer-type rotary (rope_type then a dict).
    """
    config = getattr(module, "config", None)
    rope_type = getattr(module, "rope_type", None)
    if config is None or rope_type is None:
        return None
    layer_type = buffer_name[: -len("_inv_freq")] if buffer_name != "inv_freq" else None
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type) if layer_type else None
    if not isinstance(rope_type, str):
        return None
    fn = getattr(type(module), "compute_default_rope_parameters", None) if rope_type == "default" else None
    if fn is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        return None
    with torch.device("cpu"):
        out = fn(config, layer_type=layer_type) if layer_type else fn(config)
    inv_freq = out[0] if isinstance(out, tuple) else out
    return inv_freq.to(torch.float32)


def apply_liger_kernels(model: torch.nn.Module) -> bool:
    """liger's RoPE, RMSNorm and SwiGLU kernels on this model instance (its fused linear-CE head is
    _LogProbHead's own). On the H200 they were the +28 % of the 1.7B update pass (docs/perf/h200.md).

    liger patches the instance's norms and MLPs, and modeling_<type>'s RoPE function and classes
    process-wide: fine in the learner's own process (its Ray actor). Returns False, and logs why,
    for a model type liger has no kernels for.
    """
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        log.info("learner.liger_kernels", applied=False, reason=f"liger has no kernels for model type {model_type!r}")
        return False
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    log.info("learner.liger_kernels", applied=True, model_type=model_type, kernels="rope,rms_norm,swiglu")
    return True


def limit_checkpointed_layers(model: torch.nn.Module, n: int) -> int:
    """After activation checkpointing is enabled: only the first `n` decoder layers recompute in backward
    (-1: all). Each layer left out keeps its activations (23x what a checkpointed layer keeps for
    the Qwen3-1.7B shape, 32x for 32B: launch/plan.py) and saves its forward recompute, a quarter
    of its FLOPs. Returns how many layers checkpoint. transformers' GradientCheckpointingLayer reads its
    own `gradient_checkpointing` flag on each call, so this works on any 5.x."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if n > len(layers):
        raise ValueError(f"learner.checkpoint_layers={n}: the model has {len(layers)} decoder layers")
    keep = len(layers) if n < 0 else n
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < keep
    return keep


def restore_rotary_buffers(model: torch.nn.Module) -> list[str]:
    """Recomputes every rotary `*inv_freq` buffer (and its `original_*` twin) in fp32.

    Under ZeRO-3 transformers builds the model inside deepspeed.zero.Init, which turns the buffers
    created there into the training dtype: a bf16 inv_freq is off by up to 3.7e-3 relative, so RoPE
    angles drift with position (0.68 nats mean log-prob error at ~4k tokens, docs/perf/h200.md).
    The rotary class's own init fn gives back exactly what a plain load holds; where it cannot be
    called, a non-fp32 buffer is at least cast to fp32 (with a warning: the rounding stays).
    Returns the names of the buffers that changed.
    """
    changed = []
    for mod_name, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or not name.endswith("inv_freq") or name.startswith("original_"):
                continue
            ref = _rotary_reference(module, name)
            full = f"{mod_name}.{name}" if mod_name else name
            if ref is None or ref.shape != buf.shape:
                if buf.dtype == torch.float32:
                    continue
                log.warning("learner.rotary_cast", buffer=full, dtype=str(buf.dtype),
                            reason="no rotary init fn to recompute it; cast to fp32, rounding kept")
                ref = buf.float()
            ref = ref.to(buf.device)
            if buf.dtype != ref.dtype or not torch.equal(buf, ref):
                changed.append(full)
            module._buffers[name] = ref
            twin = "original_" + name
            if module._buffers.get(twin) is not None:
                module._buffers[twin] = ref.clone()
    if changed:
        log.info("learner.rotary_restored", buffers=changed[:4], count=len(changed))
    return changed


class _OptimizerStateOffload:
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


class Learner:
    """DeepSpeed GRPO learner. See the module docstring for what it guarantees."""

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
        self.dtype = _DTYPES[learner_cfg.dtype]
        self.attn_implementation = attention.select_attn_implementation(model_cfg.attn_implementation, self.device)
        if self.attn_implementation == attention.VARLEN:
            attention.register()
        if self.attn_implementation != model_cfg.attn_implementation:
            log.info("learner.attention", requested=model_cfg.attn_implementation, using=self.attn_implementation,
                     reason="packed rows: varlen attention over cu_seqlens instead of sdpa's dense [T, T] mask"
                     if self.attn_implementation == attention.VARLEN else "auto")
        self.use_liger = bool(learner_cfg.use_liger) and self.device.type == "cuda"
        if learner_cfg.use_liger and not self.use_liger:
            log.info("learner.logprob_path", path="torch", reason="use_liger needs a CUDA device; plain log_softmax on CPU")
        else:
            log.info("learner.logprob_path", path="liger-fused-linear-ce" if self.use_liger else "torch")

        ensure_process_group(self.device)
        _skip_cpu_shm_comm_build()
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.ds_config = self._ds_config()

        # ZeRO-3: transformers builds the model under zero.Init (partitioned while loading) as long
        # as this object is alive.
        # ZeRO-3 without accelerate (not installed here): each rank loads the full model and
        # deepspeed.initialize partitions it; fine for small models, not for 32B on one host.
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
        self.head = _LogProbHead(model, self.temperature, self.use_liger)
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
        self._offloaded: _OptimizerStateOffload | None = None
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
        log.info("learner.ready", zero_stage=learner_cfg.zero_stage, dtype=learner_cfg.dtype, device=str(self.device),
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
        return _LogProbHead(ref, self.temperature, self.use_liger).to(self.device).eval()

    # ------------------------------------------------------------------ forward helpers

    def _forward(self, mb: PackedBatch, module=None, with_entropy: bool = False, temperature: float | None = None):
        module = self.engine if module is None else module
        mask = mb.attention_mask(self.attn_implementation, self.dtype)
        extra = mb.varlen_kwargs() if self.attn_implementation == attention.VARLEN else {}
        return module(mb.input_ids, mb.position_ids, mb.target_ids, attention_mask=mask,
                      with_entropy=with_entropy, temperature=temperature, **extra)

    def _materialise(self, batch: TrainBatch) -> list[dict[str, Any]]:
        """TrainBatch -> per micro-batch: the packed row and its per-position tensors, on device."""
        groups = batch.groups
        prompts = [torch.from_numpy(unpack_ids(g.prompt_tokens).astype("int64")) for g in groups]
        seen: set[tuple[int, int]] = set()
        out = []
        for m, plan in enumerate(batch.micro_batches):
            seqs, adv, gen = [], [], []
            for g, s in plan:
                if not (0 <= g < len(groups)) or not (0 <= s < len(groups[g].completions)):
                    raise ValueError(f"TrainBatch.micro_batches[{m}] names (group {g}, sample {s}), which does not exist")
                if (g, s) in seen:
                    raise ValueError(f"TrainBatch.micro_batches: (group {g}, sample {s}) appears twice")
                seen.add((g, s))
                grp = groups[g]
                comp = torch.from_numpy(unpack_ids(grp.completions[s]).astype("int64"))
                glp = torch.from_numpy(unpack_floats(grp.gen_logprobs[s]).copy()) if grp.gen_logprobs else None
                if glp is not None and len(glp) != len(comp):
                    raise ValueError(f"TrainBatch.groups[{g}].gen_logprobs[{s}] has {len(glp)} values for "
                                     f"{len(comp)} completion tokens")
                seqs.append((prompts[g], comp))
                adv.append(float(grp.advantages[s]))
                gen.append(glp)
            pb = pack(seqs)
            item = {"packed": pb.to(self.device), "advantages": pb.scatter_per_sample(adv).to(self.device),
                    "gen_logprobs": None}
            if self.cfg.tis_cap > 0 and all(x is not None for x in gen):
                item["gen_logprobs"] = pb.scatter(gen).to(self.device)
            out.append(item)
        for k, mbatch in enumerate(batch.minibatches):
            for i in mbatch:
                if not 0 <= i < len(out):
                    raise ValueError(f"TrainBatch.minibatches[{k}] names micro-batch {i}; there are {len(out)}")
        listed = sorted(i for mbatch in batch.minibatches for i in mbatch)
        if listed != list(range(len(out))):
            raise ValueError("TrainBatch.minibatches must list every micro-batch exactly once")
        return out

    def _normalizer(self, items: Sequence[dict[str, Any]]) -> float:
        if self.cfg.loss_agg == "token-mean":
            return float(max(1, sum(it["packed"].num_loss_tokens for it in items)))
        return float(max(1, sum(it["packed"].num_samples for it in items)))

    def _reduce(self, values: dict[str, float], op: str = "mean") -> dict[str, float]:
        """Scalars averaged ("mean"), summed ("sum") or maxed ("max") over ranks."""
        if self.world_size == 1 or not values:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= self.world_size
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs once, then update_epochs passes over the minibatches; one lr step."""
        if self.asleep:
            self.wake()
        t0 = time.perf_counter()
        items = self._materialise(batch)
        if not items:
            raise ValueError(f"TrainBatch for step {batch.step} has no micro-batches")
        c = self.cfg
        with torch.no_grad():
            for it in items:
                it["old_logprobs"], _ = self._forward(it["packed"])
                if self.ref_model is not None:
                    it["ref_logprobs"], _ = self._forward(it["packed"], module=self.ref_model)
        t_old = time.perf_counter() - t0

        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        per_epoch: list[dict[str, float]] = []
        grad_norms: list[float] = []
        ratio_max = 0.0
        tokens_fwd = 0

        for epoch in range(c.update_epochs):
            ep_sums: dict[str, float] = {}
            ep_w: dict[str, float] = {}
            ep_ratio_max = 0.0
            ep_losses: list[tuple[float, float]] = []
            for minibatch in batch.minibatches:
                mb_items = [items[i] for i in minibatch]
                norm = self._normalizer(mb_items)
                mb_pg = mb_loss = 0.0
                for j, it in enumerate(mb_items):
                    pb: PackedBatch = it["packed"]
                    self.engine.set_gradient_accumulation_boundary(j == len(mb_items) - 1)
                    lp, ent = self._forward(pb, with_entropy=c.entropy_coef > 0)
                    loss, m = policy_loss(
                        lp, it["old_logprobs"], it["advantages"], pb.loss_mask, clip_low=c.clip_low,
                        clip_high=c.clip_high, agg=c.loss_agg, ref_logprobs=it.get("ref_logprobs"),
                        kl_coef=c.kl_coef, entropy=ent, entropy_coef=c.entropy_coef,
                        gen_logprobs=it["gen_logprobs"], tis_cap=c.tis_cap, seq_ids=pb.sample_index,
                        normalizer=norm)
                    self.engine.backward(loss)
                    tokens_fwd += pb.num_tokens
                    w = m.pop("num_tokens")
                    ep_ratio_max = max(ep_ratio_max, m.pop("ratio_max"))
                    m.pop("ratio_min", None)
                    # Micro-batch losses are shares of the minibatch loss (same normaliser): they add up.
                    mb_pg += m.pop("pg_loss")
                    mb_loss += float(loss.detach())
                    for k, v in m.items():
                        for acc, wacc in ((sums, weights), (ep_sums, ep_w)):
                            acc[k] = acc.get(k, 0.0) + v * w
                            wacc[k] = wacc.get(k, 0.0) + w
                grad_norms.append(self._optimizer_step())
                ep_losses.append((mb_pg, mb_loss))
            per_epoch.append({k: ep_sums[k] / ep_w[k] if ep_w[k] else 0.0 for k in ep_sums})
            per_epoch[-1].update(ratio_max=ep_ratio_max, pg_loss=sum(x for x, _ in ep_losses) / len(ep_losses),
                                 loss=sum(y for _, y in ep_losses) / len(ep_losses))
            ratio_max = max(ratio_max, ep_ratio_max)
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - t0

        metrics = {k: sums[k] / weights[k] if weights[k] else 0.0 for k in sums}
        metrics["pg_loss"] = sum(e["pg_loss"] for e in per_epoch) / len(per_epoch)
        metrics["loss"] = sum(e["loss"] for e in per_epoch) / len(per_epoch)
        metrics = self._reduce(metrics)
        if c.update_epochs > 1:
            for e, em in enumerate(per_epoch):
                em = {**self._reduce(em), **self._reduce({"ratio_max": em["ratio_max"]}, op="max")}
                for k in ("ratio_mean", "ratio_max", "ppo_kl", "clipfrac", "pg_loss"):
                    if k in em:
                        metrics[f"epoch{e}/{k}"] = em[k]
        n_loss = float(sum(it["packed"].num_loss_tokens for it in items))
        n_tokens = float(sum(it["packed"].num_tokens for it in items))
        totals = self._reduce({"num_loss_tokens": n_loss, "num_tokens": n_tokens,
                               "tokens_fwd": float(tokens_fwd)}, op="sum")
        metrics.update(
            ratio_max=self._reduce({"r": ratio_max}, op="max")["r"],
            grad_norm=float(sum(grad_norms) / len(grad_norms)),
            grad_norm_max=float(max(grad_norms)),
            lr=float(self.scheduler.get_last_lr()[0]),
            optimizer_steps=float(len(grad_norms)),
            micro_batches=float(len(items)),
            num_loss_tokens=totals["num_loss_tokens"],
            num_tokens=totals["num_tokens"],
            old_logprob_s=float(t_old),
            step_s=float(elapsed),
            tokens_per_s=float(totals["tokens_fwd"] / max(elapsed - t_old, 1e-9)),
            step=float(self.step),
        )
        return metrics

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

    def sft_step(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], lr: float | None = None) -> float:
        """One optimizer step of cross-entropy on the target tokens (temperature 1). Returns the loss."""
        if self.asleep:
            self.wake()
        if not pairs:
            raise ValueError("sft_step needs at least one (prompt, target) pair")
        plan = plan_micro_batches([len(p) + len(t) for p, t in pairs], self.micro_batch_tokens)
        packed = [pack([pairs[i] for i in mb]).to(self.device) for mb in plan]
        total = float(sum(pb.num_loss_tokens for pb in packed))
        old_lrs = [g["lr"] for g in self.torch_optimizer.param_groups]
        if lr is not None:
            for g in self.torch_optimizer.param_groups:
                g["lr"] = lr
        loss_sum = 0.0
        try:
            for j, pb in enumerate(packed):
                self.engine.set_gradient_accumulation_boundary(j == len(packed) - 1)
                lp, _ = self._forward(pb, temperature=1.0)
                loss = -(lp * pb.loss_mask).sum() / max(total, 1.0)
                self.engine.backward(loss)
                loss_sum += float(loss.detach())
            self._optimizer_step()
        finally:
            for g, v in zip(self.torch_optimizer.param_groups, old_lrs):
                g["lr"] = v
        return float(self._reduce({"loss": loss_sum})["loss"])

    def logprobs(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """Per-completion-token log-probs under the current weights (temperature applied)."""
        with torch.no_grad():
            plan = plan_micro_batches([len(p) + len(c) for p, c in sequences], self.micro_batch_tokens)
            by_index: dict[int, torch.Tensor] = {}
            for mb in plan:
                pb = pack([sequences[i] for i in mb]).to(self.device)
                lp, _ = self._forward(pb)
                for i, v in zip(mb, pb.unpack(lp)):
                    by_index[i] = v.cpu()
            out = [by_index[i] for i in range(len(sequences))]
        return out

    # ------------------------------------------------------------------ weights and checkpoints

    def _gathered(self, params: list[torch.nn.Parameter]):
        if self.cfg.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return nullcontext()

    def export_weights(self, bucket_mb: float = 512, device: str = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named tensors in buckets of about `bucket_mb`, gathered module by module under ZeRO-3.

        Tied weights appear once (under their first name, as named_parameters gives them).
        """
        limit = max(1, int(bucket_mb * 2**20))
        model = self.engine.module.model
        seen: set[int] = set()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for mod_name, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            if not own:
                continue
            with self._gathered([p for _, p in own]):
                for n, p in own:
                    seen.add(id(p))
                    t = p.detach().to(device=device, dtype=self.dtype, copy=True)
                    bucket.append((f"{mod_name}.{n}" if mod_name else n, t))
                    size += t.numel() * t.element_size()
            if size >= limit:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """All weights, HF-named, on CPU (small models and tests)."""
        return {n: t for bucket in self.export_weights(bucket_mb=1 << 20) for n, t in bucket}

    def save(self, path: str) -> str:
        """DeepSpeed checkpoint (model, optimizer) plus scheduler and step. Returns the directory."""
        os.makedirs(path, exist_ok=True)
        # Collective: each rank writes its own shard (ZeRO 1-3: its optimizer partition).
        self.engine.save_checkpoint(path, tag="learner", client_state={
            "learner_step": self.step, "scheduler": self.scheduler.state_dict(), "world_size": self.world_size})
        if self.rank == 0:
            with open(os.path.join(path, WORLD_FILE), "w") as f:
                json.dump({"world_size": self.world_size, "zero_stage": self.cfg.zero_stage}, f)
        return path

    def load(self, path: str) -> int:
        """Restores what `save` wrote; returns the training step it resumes at. A checkpoint of
        another world size is refused in one line naming both (no universal-checkpoint conversion)."""
        marker = os.path.join(path, WORLD_FILE)
        saved = json.load(open(marker))["world_size"] if os.path.exists(marker) else 1
        if saved != self.world_size:
            raise ValueError(f"learner checkpoint {path} was saved by {saved} learner rank(s); this run has "
                             f"learner.num_ranks={self.world_size}: resume with learner.num_ranks={saved}")
        load_path, client = self.engine.load_checkpoint(path, tag="learner", load_optimizer_states=True,
                                                        load_lr_scheduler_states=False)
        if load_path is None:
            raise FileNotFoundError(f"no learner checkpoint under {path!r}")
        self.scheduler.load_state_dict(client["scheduler"])
        self.step = int(client["learner_step"])
        return self.step

    def export_hf(self, path: str) -> str:
        """save_pretrained of the current weights (what a server loads), plus the tokenizer files."""
        os.makedirs(path, exist_ok=True)
        model = self.engine.module.model
        if self.cfg.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
            prefix = "model."
            state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
            if self.rank == 0:
                model.save_pretrained(path, state_dict=state)
        elif self.rank == 0:
            model.save_pretrained(path)
        if self.rank == 0 and os.path.isdir(self.model_path):
            for name in os.listdir(self.model_path):
                if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or name == "generation_config.json":
                    shutil.copy2(os.path.join(self.model_path, name), os.path.join(path, name))
        return path

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
            self._offload_optimizer()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if not self.asleep:
            return
        if self._ds_offloaded:
            self.engine.reload_states()
            self._ds_offloaded = False
        if self._offloaded is not None:
            self._offloaded.reload()
            self._offloaded = None
        self.asleep = False

    def _offload_optimizer(self) -> None:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        opt = self.engine.optimizer
        pin = self.device.type == "cuda"
        stage = self.cfg.zero_stage
        t0 = time.perf_counter()
        moved = 0
        if stage in (1, 2) and hasattr(opt, "offload_states"):
            self.engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer],
                                       pin_memory=pin)
            self._ds_offloaded = True
            how = "deepspeed"
        else:
            if stage == 3 and hasattr(opt, "offload_states"):
                self.engine.offload_states(include=[S.lp_grads, S.contiguous_grad_buffer], pin_memory=pin)
                self._ds_offloaded = True
            inner = opt if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer") else opt.optimizer
            # ZeRO-3's fp32 masters sit outside the inner optimizer's param_groups between steps.
            masters = getattr(opt, "fp32_partitioned_groups_flat", []) if stage == 3 else []
            self._offloaded = _OptimizerStateOffload(inner, list(self.engine.module.parameters()), masters)
            moved = self._offloaded.offload(pin)
            how = "deepspeed+learner" if self._ds_offloaded else "learner"
        log.info("learner.offload_optimizer", zero_stage=stage, via=how, gib=round(moved / 2**30, 3),
                 s=round(time.perf_counter() - t0, 3))

def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _ExportOnly:
    """A weight-sync sender that runs the export (its ZeRO-3 gathers) and sends nothing."""

    def __init__(self, export_weights, bucket_mb: float):
        self.export_weights, self.bucket_mb, self._buckets = export_weights, bucket_mb, None

    def start(self, version: int) -> None:
        self._buckets = iter(self.export_weights(self.bucket_mb))

    def next_bucket(self) -> None:
        next(self._buckets, None)

    def abort(self) -> None:
        if self._buckets is not None and hasattr(self._buckets, "close"):
            self._buckets.close()
        self._buckets = None


# ---------------------------------------------------------------------------------------------
# Thin Ray shell: the coordinator talks to this; all behaviour lives in Learner.


class LearnerShell:
    """One learner rank: a Learner plus (rank 0) its batches stream, and its side of weight sync.

    A world of one builds its Learner in the constructor; a rank of a larger world builds it in
    `join`, once rank 0 `listen`s (actors/learner_group.py drives that).
    """

    def __init__(self, learner_cfg, model_cfg, model_path: str, total_steps: int, micro_batch_tokens: int,
                 temperature: float = 1.0, run_dir: str = "", rank: int = 0, world_size: int = 1):
        import torch

        from launch.logs import setup_logging

        torch.set_num_threads(max(1, int(learner_cfg.num_cpus)))
        if run_dir:
            setup_logging(run_dir, "learner" if world_size == 1 else f"learner-{rank}", console=False)
        self.rank, self.world_size = int(rank), int(world_size)
        self._args = (learner_cfg, model_cfg, model_path, total_steps, micro_batch_tokens, temperature)
        self._store = None
        self.learner = Learner(*self._args) if self.world_size == 1 else None
        self.trained_steps: set[int] = set()
        self.train_counts: dict[int, list[int]] = {}  # step -> [times trained, groups in its batch]
        self.sender = None
        self._taken = None  # (msg_id, batch) read from the stream, trained, not yet acked

    def listen(self) -> tuple[str, int]:
        """Rank 0 of a world > 1: binds the world's store; returns where the others connect."""
        from actors.learner_group import bind_store

        self._store, host, port = bind_store(self.world_size)
        return host, port

    def join(self, host: str, port: int) -> None:
        """Every rank of a world > 1, concurrently: joins the process group, then builds the Learner
        (deepspeed.initialize is collective)."""
        from actors.learner_group import init_world

        device = self._args[0].device
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        init_world(self.rank, self.world_size, "nccl" if cuda else "gloo", store=self._store, host=host, port=port)
        self.learner = Learner(*self._args)

    async def connect(self, redis_url: str, run_id: str) -> None:
        from queues.streams import Stream, connect

        self.batches = Stream(await connect(redis_url), run_id, "batches", group="learner")
        await self.batches.ensure_group()

    async def _take(self, step: int, timeout_s: float) -> tuple[str, TrainBatch, bytes]:
        """The batch for `step` from the stream; acks (and skips) batches of steps already trained."""
        from queues.messages import codec

        deadline = time.monotonic() + timeout_s
        entries = await self.batches.pending_mine("learner-0")
        while time.monotonic() < deadline:
            if not entries:
                entries = await self.batches.consume("learner-0", count=4, block_ms=500)
            for msg_id, data in entries:
                batch = codec(TrainBatch).decode(data)
                if batch.step in self.trained_steps or batch.step < step:
                    await self.batches.ack([msg_id])
                    continue
                if batch.step != step:
                    continue  # a later step's batch: leave it pending for its turn
                return msg_id, batch, data
            entries = []
        raise TimeoutError(f"learner: no TrainBatch for step {step} within {timeout_s:.0f}s")

    async def _finish(self, msg_id: str, batch: TrainBatch, metrics: dict) -> dict:
        self.trained_steps.add(batch.step)
        count = self.train_counts.setdefault(batch.step, [0, 0])
        count[0] += 1
        count[1] += len(batch.groups)
        await self.batches.ack([msg_id])
        return dict(metrics, train_groups=float(len(batch.groups)))

    async def train_from_stream(self, step: int, timeout_s: float = 600.0) -> dict:
        """A world of one: trains on the batch for `step`, then acks it."""
        import asyncio

        msg_id, batch, _ = await self._take(step, timeout_s)
        metrics = await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, batch)
        return await self._finish(msg_id, batch, metrics)

    async def take_batch(self, step: int, timeout_s: float = 600.0) -> list:
        """Rank 0 of a world > 1: reads the step's batch and returns [ObjectRef of its bytes] for the
        other ranks (a list, so Ray hands the reference through instead of resolving it)."""
        import ray

        msg_id, batch, data = await self._take(step, timeout_s)
        self._taken = (msg_id, batch)
        return [ray.put(data)]

    async def train_taken(self) -> dict:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, self._taken[1])

    async def train_bytes(self, data: bytes) -> dict:
        """Ranks > 0: the same step from the bytes rank 0 read."""
        import asyncio

        from queues.messages import codec

        batch = codec(TrainBatch).decode(data)
        return await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, batch)

    async def finish_taken(self, metrics: dict) -> dict:
        """Rank 0, after every rank trained: records the step and acks its message."""
        (msg_id, batch), self._taken = self._taken, None
        return await self._finish(msg_id, batch, metrics)

    def sft_step(self, pairs, lr=None) -> float:
        return self.learner.sft_step(pairs, lr=lr)

    def weight_sync_start(self, version: int, kind: str, bucket_mb: int) -> None:
        from actors import weight_sync

        if kind == "object_store" and self.rank > 0:
            # ZeRO-3: the gathers are collective; this rank exports in lockstep and drops its buckets.
            self.sender = _ExportOnly(self.learner.export_weights, bucket_mb)
        elif kind == "object_store":
            self.sender = weight_sync.ObjectStoreSender(self.learner.export_weights, bucket_mb)
        else:
            self.sender = weight_sync.CudaIpcSender(lambda mb: self.learner.export_weights(mb, device="cuda"), bucket_mb)
        self.sender.start(version)

    def weight_sync_listen(self, world_size: int, bucket_mb: int):
        """nccl transport, step 1: a new private group (NCCL on GPU, gloo on CPU) replaces any
        previous one; binds its store and returns the rendezvous the generators join."""
        from actors import weight_sync

        old, self.broadcaster = getattr(self, "broadcaster", None), None
        if old is not None:
            try:
                old.close()
            except Exception as e:  # noqa: BLE001 - a broken group (a send may still be failing in its thread)
                log.warning("learner.weight_sync_close_failed", error=repr(e)[:200])
        device = self.learner.device
        self.broadcaster = weight_sync.BroadcastSender(
            lambda mb: self.learner.export_weights(mb, device=device), bucket_mb,
            backend="nccl" if device.type == "cuda" else "gloo", device=device)
        return self.broadcaster.listen(world_size)

    async def weight_sync_init(self) -> None:
        """Step 2, concurrently with every generator's weight_sync_join."""
        import asyncio

        await asyncio.to_thread(self.broadcaster.init)

    async def weight_sync_broadcast(self, version: int) -> int:
        """Each sync, concurrently with every generator's weight_sync_broadcast_receive."""
        import asyncio

        return (await asyncio.to_thread(self.broadcaster.send, version)).version

    async def weight_sync_export_only(self) -> None:
        """nccl under ZeRO-3, ranks > 0: the export's gathers, concurrently with rank 0's broadcast."""
        import asyncio

        await asyncio.to_thread(lambda: [None for _ in self.learner.export_weights()])

    def weight_sync_next(self):
        return self.sender.next_bucket()

    def weight_sync_abort(self) -> None:
        if self.sender is not None:
            self.sender.abort()

    def save(self, path: str) -> str:
        import json
        import os

        out = self.learner.save(path)
        if self.rank > 0:
            return out
        with open(os.path.join(path, "trained_steps.json"), "w") as f:
            json.dump(sorted(self.trained_steps), f)
        with open(os.path.join(path, "train_counts.json"), "w") as f:
            json.dump({str(k): v for k, v in sorted(self.train_counts.items())}, f)
        return out

    def load(self, path: str) -> int:
        import json
        import os

        step = self.learner.load(path)
        marker = os.path.join(path, "trained_steps.json")
        if os.path.exists(marker):
            self.trained_steps = set(json.load(open(marker)))
        counts = os.path.join(path, "train_counts.json")
        if os.path.exists(counts):
            self.train_counts = {int(k): v for k, v in json.load(open(counts)).items()}
        return step

    def pid(self) -> int:
        return os.getpid()

    def sleep(self) -> None:
        self.learner.sleep()

    def wake(self) -> None:
        self.learner.wake()

    def export_hf(self, path: str) -> str:
        return self.learner.export_hf(path)

    def get_step(self) -> int:
        return self.learner.step


def __getattr__(name: str):
    # Built on first use so importing this module never imports or starts Ray.
    if name == "LearnerActor":
        import ray

        actor = ray.remote(LearnerShell)
        globals()["LearnerActor"] = actor
        return actor
    raise AttributeError(name)
