"""What the GPU learner benches share: the model shapes and their random models, BIRD-shaped batches, the FLOPs of
a batch and the card's matmul peak, our Learner built over a saved model, one timed step.

Used by bench/gpu/learner.py, learner_colo.py, share_prompt.py and vllm_sync.py (SMOKE=1: tiny shapes on CPU).

Invariants: a model directory is built once per shape under $ARL_BENCH_WORK (seed 0, bf16, a tiny local
tokenizer; nothing downloaded); batches are random but seeded, so every variant of one run trains the same
tokens; `timed_step` synchronises the device on both sides of the step it times.
"""
from __future__ import annotations

import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
OUT = os.environ.get("OUT") or "/tmp/arl_h200_out"
WORK = os.environ.get("ARL_BENCH_WORK", "/tmp/arl_h200")
os.makedirs(OUT, exist_ok=True)
os.makedirs(WORK, exist_ok=True)

SHAPES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
}
# BIRD-like lengths: prompt ~3000, response ~1200, 16 samples per prompt.
LENS = dict(prompt=(2700, 3300), response=(800, 1600), n=16) if not SMOKE else dict(prompt=(20, 40), response=(6, 18), n=4)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- model directories

def build_model_dir(name: str) -> str:
    """Random-init Qwen3 of shape `name` (seed 0, bf16) + a tiny local tokenizer, saved once."""
    path = os.path.join(WORK, f"model_{name}")
    if os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.tiny_model import build_tokenizer

    tok = build_tokenizer(None, 300, path)
    kw = SHAPES[name]
    cfg = Qwen3Config(tie_word_embeddings=True, max_position_embeddings=40960, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, **kw)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    del model
    return path


# --------------------------------------------------------------------------- varlen attention

def varlen_check() -> dict:
    """The Learner's "varlen" attention (actors/learner/attention.py) against one sdpa(is_causal) per sample,
    fwd + bwd, bf16, GQA, on this machine (CUDA: torch varlen_attn; CPU: its per-sample fallback)."""
    import torch

    from actors.learner import attention

    attention.register()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = dict(kernel="torch varlen_attn" if dev == "cuda" and attention.torch_varlen_available() else "sdpa per sample",
               flash_attn_installed=attention.flash_attn_installed(),
               learner_picks_for_sdpa=attention.select_attn_implementation("sdpa", dev))
    try:
        g = torch.Generator(device=dev).manual_seed(1)
        bounds = [0, 700, 1500, 2300] if dev == "cuda" else [0, 7, 15, 23]
        T, d = bounds[-1], (128 if dev == "cuda" else 16)
        mk = lambda h: torch.randn(1, h, T, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
        q, k, v = mk(16), mk(8), mk(8)
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        o1, _ = attention.varlen_attention_forward(None, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=cu,
                                                   max_length_q=max(b - a for a, b in zip(bounds, bounds[1:])))
        g1 = torch.autograd.grad(o1.float().square().sum(), (q, k, v))
        o2 = attention._per_sample_sdpa(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, d ** -0.5)
        g2 = torch.autograd.grad(o2.float().square().sum(), (q, k, v))
        err = float((o1[0].float() - o2.float()).abs().max())
        gerr = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(g1, g2))
        out["check"] = f"vs per-sample sdpa: out max abs {err:.2e}, grad max rel {gerr:.2e}"
        out["ok"] = err < 2e-2 and gerr < 2e-2
    except Exception as e:  # noqa: BLE001 - recorded in the row
        out["check"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        out["ok"] = False
    return out


# --------------------------------------------------------------------------- batches

def make_groups(n_prompts: int, vocab: int, seed: int):
    """Random BIRD-shaped groups: (prompt ids, [completion ids]*n)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_prompts):
        p = rng.integers(1, vocab, int(rng.integers(*LENS["prompt"])))
        comps = [rng.integers(1, vocab, int(rng.integers(*LENS["response"]))) for _ in range(LENS["n"])]
        groups.append((p, comps))
    return groups


def train_groups(groups, step: int, seed: int) -> list:
    """TrainGroups of `groups` ((prompt, [completions]) as make_groups): random 0/1 rewards (never all equal),
    their group-normalised advantages and random sampler log-probs, seeded."""
    import numpy as np

    from queues.messages import TrainGroup, pack_floats, pack_ids

    rng = np.random.default_rng(seed + 1000)
    tgs = []
    for gi, (p, comps) in enumerate(groups):
        rewards = rng.integers(0, 2, len(comps)).astype(float)
        if rewards.std() == 0:
            rewards[0] = 1 - rewards[0]
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
        tgs.append(TrainGroup(prompt_id=f"p{gi}", prompt_tokens=pack_ids(p), completions=[pack_ids(c) for c in comps],
                              gen_logprobs=[pack_floats(-rng.random(len(c)).astype("float32")) for c in comps],
                              advantages=adv, rewards=rewards.tolist(), policy_version=step))
    return tgs


def make_train_batch(groups, mb_tokens: int, step: int = 0, seed: int = 0):
    """One TrainBatch of `groups`, planned per sample under `mb_tokens`."""
    from policies.packing import plan_micro_batches
    from queues.messages import TrainBatch

    flat = [(gi, si) for gi, (_, comps) in enumerate(groups) for si in range(len(comps))]
    lengths = [len(groups[gi][0]) + len(groups[gi][1][si]) for gi, si in flat]
    plan = plan_micro_batches(lengths, mb_tokens)
    mbs = [[flat[i] for i in mb] for mb in plan]
    return TrainBatch(step=step, policy_version=step, groups=train_groups(groups, step, seed), micro_batches=mbs,
                      minibatches=[list(range(len(mbs)))], num_tokens=sum(lengths))


def batch_flops(groups, kw, n_params: int) -> tuple[float, float, int]:
    """(train-pass FLOPs = 6 N T + causal attention fwd+bwd, forward-only FLOPs, T) over every sample."""
    L, H, hd = kw["num_hidden_layers"], kw["num_attention_heads"], kw["head_dim"]
    lens = [len(p) + len(c) for p, comps in groups for c in comps]
    T = sum(lens)
    s2 = sum(s * s for s in lens)
    train = 6 * n_params * T + 6 * L * H * hd * s2   # causal: 2*s^2*H*hd per layer fwd (QK^T + PV halved), x3 fwd+bwd
    fwd = 2 * n_params * T + 2 * L * H * hd * s2
    return float(train), float(fwd), T


def matmul_peak() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    peak = 20 * 2 * 8192 ** 3 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return peak


# --------------------------------------------------------------------------- learner construction

def make_learner(model: str, zero: int, attn: str, path: str, mb_tokens: int, lr: float = 1e-6, gc: bool = True, **extra):
    """Our Learner over the saved random model; returns (learner, info). path: plain, liger (the
    fused head alone: learner.liger_kernels=false) or lk (learner.use_liger as shipped: head + the
    RoPE/RMSNorm/SwiGLU kernels the Learner applies to its model)."""
    import torch

    from config import LearnerConfig, ModelConfig

    info = {}
    extra.setdefault("share_prompt", False)  # today's unshared paths (bench/gpu/share_prompt.py measures sharing)
    # "varlen": the Learner's own attention (actors/learner/attention.py), asked for by name so the CPU smoke
    # runs it too; on a GPU without flash_attn the Learner picks it for "sdpa" by itself, so the
    # dense-mask sdpa row is forced with "sdpa_dense" below.
    impl = attn
    if attn == "varlen":
        info["varlen"] = varlen_check()
    elif attn == "sdpa_dense":
        from actors.learner import attention

        attention.select_attn_implementation = lambda requested, device, share_prompt=False: "sdpa"  # this process only
        impl = "sdpa"
    mdir = build_model_dir(model)
    lcfg = LearnerConfig(zero_stage=zero, dtype="bfloat16", lr=lr, use_liger=path in ("liger", "lk"), liger_kernels=path == "lk",
                         gradient_checkpointing=gc, device="cuda" if torch.cuda.is_available() else "cpu",
                         **extra)
    mcfg = ModelConfig(path=mdir, attn_implementation=impl)
    t = time.perf_counter()
    learner = Learner_cls()(lcfg, mcfg, mdir, total_steps=100, micro_batch_tokens=mb_tokens, temperature=1.0)
    info["init_s"] = round(time.perf_counter() - t, 2)
    info["attn_implementation"] = learner.attn_implementation
    info["liger_kernels_applied"] = bool(learner.liger_kernels)
    return learner, info


def Learner_cls():
    from actors.learner.learner import Learner

    return Learner


def timed_step(learner, batch, i: int) -> tuple[float, dict]:
    """(seconds, metrics) of one Learner.train_step, the device synchronised on both sides; logs one line."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    m = learner.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    log(f"  step {i}: {dt:.2f}s old_lp {m['old_logprob_s']:.2f}s micro_batches {m['micro_batches']:.0f} "
        f"tokens {m['num_tokens']:.0f} loss {m.get('loss', float('nan')):.4f} grad_norm {m['grad_norm']:.3f}")
    return dt, m
