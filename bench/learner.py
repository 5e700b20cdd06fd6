"""Learner benchmark (run by hand): packing efficiency on BIRD-like lengths, and CPU train_step speed.

    .venv/bin/python -m bench.learner                      # both parts
    .venv/bin/python -m bench.learner --skip-cpu           # packing only (pure, a second)

Part 1 compares, for the same synthetic step (128 prompts x 16 samples, prompts lognormal around
3,000 tokens, responses lognormal around 1,200 with a long tail capped at max_tokens), the seed's
layout (every sample padded to [max prompt + max response]) with token-budget packing
(policies/packing.py). "padding" for packing counts the slots left empty when each micro-batch is
padded to its full budget (a static-shape kernel); the varlen path pads nothing at all.
Part 2 times Learner.train_step for the tiny Qwen3 on this CPU (fp32, ZeRO 0, sdpa + block mask).
Output is a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np


def bird_like_lengths(prompts: int, n: int, seed: int, max_prompt: int, max_response: int):
    rng = np.random.default_rng(seed)
    # Prompt length is set by the schema: one per group; lognormal with median 3,000.
    p = np.clip(rng.lognormal(np.log(3000), 0.25, prompts), 600, max_prompt).astype(int)
    # Responses: median ~1,000, mean ~1,200, a long tail up to the generation cap.
    r = np.clip(rng.lognormal(np.log(1000), 0.6, (prompts, n)), 20, max_response).astype(int)
    return p, r


def packing_rows(prompts, n, seed, budgets, max_prompt, max_response):
    from policies.packing import padding_fraction, plan_micro_batches

    p, r = bird_like_lengths(prompts, n, seed, max_prompt, max_response)
    lengths = [int(p[g] + r[g, s]) for g in range(prompts) for s in range(n)]
    useful = sum(lengths)
    rows = []
    width = int(p.max() + r.max())
    seed_slots = len(lengths) * width
    rows.append(("seed [B, P+R] padded", f"[{len(lengths)}, {width}]", 1.0 - useful / seed_slots,
                 seed_slots / prompts, "-"))
    for budget in budgets:
        t = time.perf_counter()
        plan = plan_micro_batches(lengths, budget)
        dt = time.perf_counter() - t
        pad = padding_fraction(lengths, plan, budget)
        rows.append((f"packed, budget {budget}", f"{len(plan)} x [1, <= {budget}]", pad,
                     len(plan) * budget / prompts, f"{dt * 1e3:.0f} ms"))
    rows.append(("packed, varlen (no padding)", "-", 0.0, useful / prompts, "-"))
    stats = dict(prompt_mean=float(p.mean()), prompt_max=int(p.max()), resp_mean=float(r.mean()),
                 resp_p50=float(np.median(r)), resp_p99=float(np.percentile(r, 99)), resp_max=int(r.max()),
                 samples=len(lengths), useful_per_group=useful / prompts)
    return rows, stats


def cpu_rows(steps: int, groups: int, n: int, budget: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from actors.learner import Learner
    from launch.config import LearnerConfig, ModelConfig
    from policies.packing import plan_micro_batches, split_minibatches
    from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, head_dim=16)
    path = tempfile.mkdtemp(prefix="bench_learner_")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    rng = np.random.default_rng(0)
    learner = Learner(LearnerConfig(zero_stage=0, dtype="float32", lr=1e-4, device="cpu"),
                      ModelConfig(dtype="float32", attn_implementation="sdpa"), path, total_steps=steps + 1,
                      micro_batch_tokens=budget)
    rows = []
    for step in range(steps + 1):
        tgroups = []
        for g in range(groups):
            prompt = rng.integers(0, 256, int(np.clip(rng.lognormal(np.log(300), 0.25), 50, 800)))
            comps = [rng.integers(0, 256, int(np.clip(rng.lognormal(np.log(100), 0.6), 4, 400))) for _ in range(n)]
            tgroups.append(TrainGroup(prompt_id=str(g), prompt_tokens=pack_ids(prompt),
                                      completions=[pack_ids(c) for c in comps],
                                      gen_logprobs=[pack_floats(np.zeros(len(c))) for c in comps],
                                      advantages=rng.standard_normal(n).tolist(), rewards=[0.0] * n, policy_version=0))
        pairs = [(g, s) for g in range(groups) for s in range(n)]
        lengths = [len(tgroups[g].prompt_tokens) // 4 + len(tgroups[g].completions[s]) // 4 for g, s in pairs]
        plan = plan_micro_batches(lengths, budget)
        batch = TrainBatch(step=step, policy_version=0, groups=tgroups, micro_batches=[[pairs[i] for i in mb] for mb in plan],
                           minibatches=split_minibatches(plan, 1, lengths))
        m = learner.train_step(batch)
        if step == 0:
            continue  # warm-up
        rows.append(m)
    tok = sum(m["num_tokens"] for m in rows)
    total = sum(m["step_s"] for m in rows)
    old = sum(m["old_logprob_s"] for m in rows)
    return dict(tokens_per_step=tok / len(rows), micro_batches=rows[0]["micro_batches"],
                train_step_tok_s=tok / total, fwd_bwd_tok_s=tok / (total - old), fwd_only_tok_s=tok / old,
                step_s=total / len(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="16384,32768")
    ap.add_argument("--max-prompt", type=int, default=8192)
    ap.add_argument("--max-response", type=int, default=4096)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--cpu-steps", type=int, default=3)
    ap.add_argument("--cpu-groups", type=int, default=8)
    ap.add_argument("--cpu-n", type=int, default=4)
    ap.add_argument("--cpu-budget", type=int, default=2048)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]

    rows, st = packing_rows(args.prompts, args.n, args.seed, budgets, args.max_prompt, args.max_response)
    print(f"## Packing: {args.prompts} prompts x {args.n} samples (seed {args.seed})\n")
    print(f"prompt mean {st['prompt_mean']:.0f} (max {st['prompt_max']}), response mean {st['resp_mean']:.0f} "
          f"(p50 {st['resp_p50']:.0f}, p99 {st['resp_p99']:.0f}, max {st['resp_max']}), "
          f"useful tokens per group {st['useful_per_group']:,.0f}\n")
    print("| layout | shape | padding | learner tokens per group | plan time |")
    print("| --- | --- | --- | --- | --- |")
    for name, shape, pad, per_group, dt in rows:
        print(f"| {name} | {shape} | {pad * 100:.1f} % | {per_group:,.0f} | {dt} |")
    if not args.skip_cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "2")
        r = cpu_rows(args.cpu_steps, args.cpu_groups, args.cpu_n, args.cpu_budget)
        print(f"\n## CPU train_step, tiny Qwen3 (h64, 2 layers, vocab 256), fp32, ZeRO 0, sdpa + block mask "
              f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n")
        print("| tokens/step | micro-batches | step s | train_step tok/s | fwd+bwd tok/s | old-logprob fwd tok/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {r['tokens_per_step']:,.0f} | {r['micro_batches']:.0f} | {r['step_s']:.2f} | "
              f"{r['train_step_tok_s']:,.0f} | {r['fwd_bwd_tok_s']:,.0f} | {r['fwd_only_tok_s']:,.0f} |")


if __name__ == "__main__":
    main()
