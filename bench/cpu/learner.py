"""Learner benchmark (run by hand): packing efficiency on BIRD-like lengths, and CPU train_step speed.

    .venv/bin/python -m bench.cpu.learner                      # both parts
    .venv/bin/python -m bench.cpu.learner --skip-cpu           # packing only (pure, a second)
    .venv/bin/python -m bench.cpu.learner --cpu-shape tiny     # the CPU part at the tiny recipe's shapes

Part 1 compares, for the same synthetic step (128 prompts x 16 samples, prompts lognormal around
3,000 tokens, responses lognormal around 1,200 with a long tail capped at max_tokens), the seed's
layout (every sample padded to [max prompt + max response]) with token-budget packing
(policies/packing.py). "padding" for packing counts the slots left empty when each micro-batch is
padded to its full budget (a static-shape kernel); the varlen path pads nothing at all.
Part 1b: learner tokens per step with learner.share_prompt (policies/prefix.py: each group's prompt
once per micro-batch, groups planned as units) against one prompt copy per sample, same step.
Part 2 times Learner.train_step on this CPU (fp32, ZeRO 0, the learner's CPU attention: one sdpa per attention segment), unshared and
shared on the same batches. Output is markdown tables on stdout.
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
    shared = []
    for budget in budgets:
        shared.append(share_row(p, r, budget))
    stats = dict(prompt_mean=float(p.mean()), prompt_max=int(p.max()), resp_mean=float(r.mean()),
                 resp_p50=float(np.median(r)), resp_p99=float(np.percentile(r, 99)), resp_max=int(r.max()),
                 samples=len(lengths), useful_per_group=useful / prompts)
    return rows, shared, stats


def share_row(p, r, budget: int) -> dict:
    """Learner tokens and micro-batches of one step, one prompt copy per sample vs share_prompt."""
    from policies.packing import plan_micro_batches
    from policies.prefix import plan_group_micro_batches

    lengths = [int(p[g] + r[g, s]) for g in range(len(p)) for s in range(r.shape[1])]
    t = time.perf_counter()
    unshared = plan_micro_batches(lengths, budget)
    t_u = time.perf_counter() - t
    t = time.perf_counter()
    plan, tokens = plan_group_micro_batches([int(x) for x in p], [[int(x) for x in row] for row in r], budget)
    t_s = time.perf_counter() - t
    parts = sum(len({g for g, _ in mb}) for mb in plan)
    return dict(budget=budget, unshared_tokens=sum(lengths), unshared_mbs=len(unshared), shared_tokens=sum(tokens),
                shared_mbs=len(plan), parts=parts, groups=len(p), plan_ms=(t_u * 1e3, t_s * 1e3))


CPU_SHAPES = {
    # bench default: prompts ~300, responses ~100 (lognormal), 8 groups x 4, budget 2048, h64 x 2 layers
    "default": dict(prompt=300, response=100, groups=8, n=4, budget=2048, hidden=64, vocab=256),
    # the tiny recipe: prompts <= 256, 8 samples of <= 48 tokens, 16 prompts a step, budget 4096, h128
    "tiny": dict(prompt=180, response=30, groups=16, n=8, budget=4096, hidden=128, vocab=640),
}


def cpu_rows(steps: int, shape: dict, share: bool, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from actors.learner.learner import Learner
    from config import LearnerConfig, ModelConfig
    from policies.packing import plan_micro_batches, split_minibatches
    from policies.prefix import plan_group_micro_batches
    from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids

    torch.manual_seed(0)
    h, vocab, budget = shape["hidden"], shape["vocab"], shape["budget"]
    cfg = Qwen3Config(hidden_size=h, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=2 * h, vocab_size=vocab, head_dim=h // 4)
    path = tempfile.mkdtemp(prefix="bench_learner_")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    rng = np.random.default_rng(seed)
    learner = Learner(LearnerConfig(zero_stage=0, dtype="float32", lr=1e-4, device="cpu", share_prompt=share),
                      ModelConfig(dtype="float32", attn_implementation="sdpa"), path, total_steps=steps + 1,
                      micro_batch_tokens=budget)
    rows = []
    for step in range(steps + 1):
        tgroups = []
        for g in range(shape["groups"]):
            prompt = rng.integers(0, vocab, int(np.clip(rng.lognormal(np.log(shape["prompt"]), 0.25), 20,
                                                        4 * shape["prompt"])))
            comps = [rng.integers(0, vocab, int(np.clip(rng.lognormal(np.log(shape["response"]), 0.6), 4,
                                                        4 * shape["response"]))) for _ in range(shape["n"])]
            tgroups.append(TrainGroup(prompt_id=str(g), prompt_tokens=pack_ids(prompt),
                                      completions=[pack_ids(c) for c in comps],
                                      gen_logprobs=[pack_floats(np.zeros(len(c))) for c in comps],
                                      advantages=rng.standard_normal(shape["n"]).tolist(), rewards=[0.0] * shape["n"],
                                      policy_version=0))
        if share:
            mbs, tokens = plan_group_micro_batches([len(t.prompt_tokens) // 4 for t in tgroups],
                                                   [[len(c) // 4 for c in t.completions] for t in tgroups], budget)
            minibatches = split_minibatches(mbs, 1, tokens=tokens)
        else:
            pairs = [(g, s) for g in range(len(tgroups)) for s in range(shape["n"])]
            lengths = [len(tgroups[g].prompt_tokens) // 4 + len(tgroups[g].completions[s]) // 4 for g, s in pairs]
            plan = plan_micro_batches(lengths, budget)
            mbs, minibatches = [[pairs[i] for i in mb] for mb in plan], split_minibatches(plan, 1, lengths)
        m = learner.train_step(TrainBatch(step=step, policy_version=0, groups=tgroups, micro_batches=mbs,
                                          minibatches=minibatches))
        if step == 0:
            continue  # warm-up
        rows.append(m)
    tok = sum(m["num_tokens"] for m in rows)
    total = sum(m["step_s"] for m in rows)
    old = sum(m["old_logprob_s"] for m in rows)
    samples = shape["groups"] * shape["n"] * len(rows)
    return dict(tokens_per_step=tok / len(rows), micro_batches=rows[0]["micro_batches"],
                train_step_tok_s=tok / total, fwd_bwd_tok_s=tok / (total - old), fwd_only_tok_s=tok / old,
                step_s=total / len(rows), samples_per_s=samples / total)


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
    ap.add_argument("--cpu-shape", choices=sorted(CPU_SHAPES), default="default")
    ap.add_argument("--cpu-share", choices=["both", "off", "on"], default="both",
                    help="learner.share_prompt for the CPU part (both: unshared then shared, same batches)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]

    rows, shared, st = packing_rows(args.prompts, args.n, args.seed, budgets, args.max_prompt, args.max_response)
    print(f"## Packing: {args.prompts} prompts x {args.n} samples (seed {args.seed})\n")
    print(f"prompt mean {st['prompt_mean']:.0f} (max {st['prompt_max']}), response mean {st['resp_mean']:.0f} "
          f"(p50 {st['resp_p50']:.0f}, p99 {st['resp_p99']:.0f}, max {st['resp_max']}), "
          f"useful tokens per group {st['useful_per_group']:,.0f}\n")
    print("| layout | shape | padding | learner tokens per group | plan time |")
    print("| --- | --- | --- | --- | --- |")
    for name, shape, pad, per_group, dt in rows:
        print(f"| {name} | {shape} | {pad * 100:.1f} % | {per_group:,.0f} | {dt} |")
    print("\n## learner.share_prompt: learner tokens per step, same step\n")
    print("| micro_batch_tokens | unshared tokens (micro-batches) | shared tokens (micro-batches) | prompt copies "
          "per group | fewer tokens | plan ms unshared / shared |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in shared:
        print(f"| {r['budget']:,} | {r['unshared_tokens']:,} ({r['unshared_mbs']}) | {r['shared_tokens']:,} "
              f"({r['shared_mbs']}) | {r['parts'] / r['groups']:.2f} | "
              f"{r['unshared_tokens'] / r['shared_tokens']:.2f}x | {r['plan_ms'][0]:.0f} / {r['plan_ms'][1]:.0f} |")
    if not args.skip_cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "2")
        shape = CPU_SHAPES[args.cpu_shape]
        print(f"\n## CPU train_step, {args.cpu_shape} shape {shape}: Qwen3 h{shape['hidden']}, 2 layers, fp32, "
              f"ZeRO 0, sdpa per attention segment ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n")
        print("| share_prompt | tokens/step | micro-batches | step s | samples/s | train_step tok/s | fwd+bwd tok/s | "
              "old-logprob fwd tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for share in {"both": (False, True), "off": (False,), "on": (True,)}[args.cpu_share]:
            r = cpu_rows(args.cpu_steps, shape, share)
            print(f"| {'on' if share else 'off'} | {r['tokens_per_step']:,.0f} | {r['micro_batches']:.0f} | "
                  f"{r['step_s']:.2f} | {r['samples_per_s']:.1f} | {r['train_step_tok_s']:,.0f} | "
                  f"{r['fwd_bwd_tok_s']:,.0f} | {r['fwd_only_tok_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
