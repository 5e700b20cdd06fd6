"""Learner step time for the same global batch with 1 and 2 learner ranks on CPU (run by hand).

    .venv/bin/python -m bench.cpu.learner_ranks                 # ~2 min on 2 idle cores
    .venv/bin/python -m bench.cpu.learner_ranks --steps 4 --hidden 256 --layers 4 --vocab 4096

Real LearnerGroups (Ray actors, DeepSpeed ZeRO over gloo) on a local Ray cluster of 2 CPUs, fp32, a
random Qwen3-shaped model. Every configuration trains the same TrainBatches (the bytes every rank
gets in a run); the time is rank 0's `step_s` (the whole train_step: old log-probs, forward/backward,
optimizer step, the metric reduction), median over the measured steps after one warm-up step.
Configurations: 1 rank x 1 thread, 1 rank x 2 threads (the whole machine in one process), 2 ranks x
1 thread. Output is a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time


def make_batches(steps: int, groups: int, n: int, budget: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    from policies.packing import plan_micro_batches, split_minibatches
    from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids

    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        tgroups = []
        for g in range(groups):
            prompt = rng.integers(0, vocab, int(rng.integers(96, 160)))
            comps = [rng.integers(0, vocab, int(rng.integers(16, 128))) for _ in range(n)]
            tgroups.append(TrainGroup(prompt_id=f"p{g}", prompt_tokens=pack_ids(prompt),
                                      completions=[pack_ids(c) for c in comps],
                                      gen_logprobs=[pack_floats(np.full(len(c), -5.0)) for c in comps],
                                      advantages=rng.standard_normal(n).tolist(), rewards=[0.0] * n,
                                      policy_version=0))
        pairs = [(g, s) for g in range(groups) for s in range(n)]
        lengths = [len(tgroups[g].prompt_tokens) // 4 + len(tgroups[g].completions[s]) // 4 for g, s in pairs]
        plan = plan_micro_batches(lengths, budget)
        out.append(TrainBatch(step=step, policy_version=0, groups=tgroups, micro_batches=[[pairs[i] for i in mb] for mb in plan],
                              minibatches=split_minibatches(plan, 1, lengths)))
    return out


def measure(cfg, model_dir: str, run_dir: str, batches: list, ranks: int, threads: int) -> dict:
    import ray

    from config import RunContext
    from launch.create import create_learner
    from queues.messages import TrainBatch, codec

    cfg.learner.num_ranks = ranks
    cfg.learner.num_cpus = float(threads)
    t0 = time.perf_counter()
    group = create_learner(cfg, RunContext.of(cfg, "", run_dir, ""), model_dir, len(batches), f"bench{ranks}x{threads}")
    try:
        step_s = []
        for batch in batches:
            ref = ray.put(codec(TrainBatch).encode(batch))
            metrics = ray.get([r.train_bytes.remote(ref) for r in group.ranks], timeout=1800)
            step_s.append(metrics[0]["step_s"])
        ready_s = time.perf_counter() - t0 - sum(step_s)
    finally:
        group.kill()
    measured = step_s[1:] or step_s
    return {"ranks": ranks, "threads": threads, "step_s": statistics.median(measured), "all": step_s,
            "micro_batches": len(batches[0].micro_batches), "tokens": metrics[0]["num_tokens"], "ready_s": ready_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is a warm-up)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--budget", type=int, default=1024, help="micro-batch token budget")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--zero-stage", type=int, default=1)
    args = ap.parse_args()

    import ray
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from config import LearnerConfig, ModelConfig
    from config.recipes import tiny

    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="bench_learner_ranks_")
    model_dir = os.path.join(root, "model")
    AutoModelForCausalLM.from_config(Qwen3Config(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64), intermediate_size=args.hidden * 3, vocab_size=args.vocab,
        head_dim=32)).save_pretrained(model_dir)
    cfg = tiny()
    cfg.model = ModelConfig(dtype="float32", attn_implementation="sdpa")
    cfg.learner = LearnerConfig(zero_stage=args.zero_stage, dtype="float32", lr=1e-4, device="cpu")
    batches = make_batches(args.steps, args.groups, args.samples, args.budget, args.vocab)
    os.environ["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"))
    load0 = os.getloadavg()[0]
    try:
        rows = [measure(cfg, model_dir, root, batches, ranks, threads) for ranks, threads in ((1, 1), (1, 2), (2, 1))]
    finally:
        ray.shutdown()
    base = rows[0]["step_s"]
    print(f"learner step, same global batch: {rows[0]['micro_batches']} micro-batches, {rows[0]['tokens']:.0f} tokens; "
          f"Qwen3-shaped {args.layers} x {args.hidden}, vocab {args.vocab}, fp32, ZeRO-{args.zero_stage} over gloo; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load0:.2f} at start")
    print()
    print("| learner ranks x threads | step s (median) | speed-up vs 1 x 1 | steps (s) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['ranks']} x {r['threads']} | {r['step_s']:.2f} | {base / r['step_s']:.2f}x | "
              f"{', '.join(f'{s:.2f}' for s in r['all'])} |")


if __name__ == "__main__":
    main()
