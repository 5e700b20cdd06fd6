"""The model side of the learner: the log-prob head, liger's kernels, checkpointed layers, rotary buffers.

Invariants:
- `LogProbHead` holds the model and computes per-token log-probs of the targets at a given
  temperature in one module's forward, so ZeRO-3 gathers lm_head inside a forward; the logits are
  divided by the sampler's temperature, so learner and sampler log-probs are of one distribution.
- The liger path (CUDA only) never materialises the full logits; both paths give the same values
  (lm_head has no bias in Qwen3, so (h / T) W^T == (h W^T) / T).
- Rotary `inv_freq` buffers are fp32 exactly as a plain load computes them, whatever zero.Init or
  DeepSpeed cast them to.
- liger's kernel patching touches process-wide modeling code: it runs only in a learner process.
"""
from __future__ import annotations

import structlog
import torch

log = structlog.get_logger("arctic_rl.learner")


class LogProbHead(torch.nn.Module):
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
        # attn_kwargs: cu_seq_lens_q/k, max_length_q/k for the "varlen" attention (actors/learner/attention.py);
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
    LogProbHead's own). On the H200 they were the +28 % of the 1.7B update pass (docs/perf/h200.md).

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
