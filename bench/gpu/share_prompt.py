"""H200 bench for learner.share_prompt (issue 15): the same BIRD-shaped groups through our Learner
(1.7B shape, use_liger, ZeRO-0) unshared on today's varlen path, unshared on flex (the kernel alone,
same tokens), and shared (each group's prompt once, flex over segment + branch ids): step time,
samples/s, peak memory, and the bf16 log-probs of the same samples against the unshared path.

    python -m bench.gpu.share_prompt              # the H200 (wheels as in docs/perf/h200.md)
    SMOKE=1 python -m bench.gpu.share_prompt      # CPU, tiny shapes: the plumbing only (shared on the dense mask)

Env: MODEL (1.7B), PROMPTS (groups per step, 4), STEPS (timed steps after WARMUP, 3), WARMUP (1),
MB_TOKENS (micro_batch_tokens, 32768 as the bird recipes), GC (1: gradient checkpointing as the bird
recipes; 0 off), VARIANTS (comma list of unshared, unshared_flex, shared), VARIANT_TIMEOUT (s), OUT.
Every variant runs in its own process (liger's patch is process-wide; a clean peak-memory counter).
Same groups per step in every variant (seeded); the unshared plan is policies.packing's per-sample
plan, the shared one policies.prefix's group plan, both under MB_TOKENS. Results: $OUT/h200_prefix.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.gpu.learner_kit import OUT, SMOKE, WORK, log, make_groups, make_learner, timed_step, train_groups  # noqa: E402

ATTN = {"unshared": "varlen", "unshared_flex": "prefix_flex", "shared": "sdpa"}  # sdpa + share -> flex on CUDA


def make_batch(groups, mb_tokens: int, share: bool, step: int, seed: int):
    """One TrainBatch of `groups` ((prompt, [completions]) as bench.gpu.learner_kit.make_groups), planned per sample
    (unshared) or per group (shared)."""
    from policies.packing import plan_micro_batches
    from policies.prefix import plan_group_micro_batches
    from queues.messages import TrainBatch

    tgs = train_groups(groups, step, seed)
    if share:
        mbs, tokens = plan_group_micro_batches([len(p) for p, _ in groups], [[len(c) for c in cs] for _, cs in groups],
                                               mb_tokens)
    else:
        flat = [(g, s) for g, (_, cs) in enumerate(groups) for s in range(len(cs))]
        lengths = [len(groups[g][0]) + len(groups[g][1][s]) for g, s in flat]
        plan = plan_micro_batches(lengths, mb_tokens)
        mbs, tokens = [[flat[i] for i in mb] for mb in plan], [sum(lengths[i] for i in mb) for mb in plan]
    return TrainBatch(step=step, policy_version=step, groups=tgs, micro_batches=mbs, minibatches=[list(range(len(mbs)))],
                      num_tokens=sum(tokens))


def per_sample_logprobs(learner, batch) -> dict:
    import torch

    out = {}
    with torch.no_grad():
        for plan, it in zip(batch.micro_batches, learner._materialise(batch)):
            pb = learner._on_device(it)["packed"]
            for pair, lp in zip(plan, pb.unpack(learner._forward(pb)[0])):
                out[pair] = lp.float().cpu()
    return out


def run_variant(spec: dict) -> dict:
    import torch

    name, share = spec["name"], spec["name"] == "shared"
    cuda = torch.cuda.is_available()
    model, mbt = spec["model"], spec["mb_tokens"]
    row = dict(spec)
    learner, info = make_learner(model, 0, ATTN[name], "lk", mbt, gc=spec["gc"], share_prompt=share)
    row.update(info, attn_implementation=learner.attn_implementation, share_prompt=share)
    from bench.gpu.learner_kit import SHAPES

    vocab = SHAPES[model]["vocab_size"]
    # bf16 log-probs of fixed samples before any update (same weights in every variant)
    lp_batch = make_batch(make_groups(1, vocab, seed=99), mbt, share, step=0, seed=99)
    t = time.perf_counter()
    lps = per_sample_logprobs(learner, lp_batch)
    row["lp_first_call_s"] = round(time.perf_counter() - t, 2)  # includes flex compilation
    torch.save(lps, os.path.join(WORK, f"lp_prefix_{name}.pt"))
    prompts, steps, warm = spec["prompts"], spec["steps"], spec["warmup"]
    batches = [make_batch(make_groups(prompts, vocab, seed=s), mbt, share, step=s, seed=s) for s in range(warm + steps)]
    if share and learner.attn_implementation == "prefix_flex":  # the block mask's cost, once per micro-batch
        from actors.learner.attention_flex import build_block_mask

        pb = learner._on_device(learner._materialise(batches[0])[0])["packed"]
        build_block_mask(pb.segment_ids, pb.branch_ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        build_block_mask(pb.segment_ids, pb.branch_ids)
        torch.cuda.synchronize()
        row["block_mask_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    times, ms = [], []
    for i, b in enumerate(batches):
        if i == warm and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dt, m = timed_step(learner, b, i)
        if i >= warm:
            times.append(dt)
            ms.append(m)
    n_samples = sum(len(g.completions) for g in batches[-1].groups)
    step_s = sum(times) / len(times)
    row.update(step_s=round(step_s, 3), step_s_each=[round(x, 3) for x in times],
               old_lp_s=round(sum(m["old_logprob_s"] for m in ms) / len(ms), 3),
               samples_per_step=n_samples, samples_per_s=round(n_samples / step_s, 2),
               tokens_per_step=int(sum(m["num_tokens"] for m in ms) / len(ms)),
               micro_batches=[int(m["micro_batches"]) for m in ms],
               learner_tok_s=round(sum(m["num_tokens"] for m in ms) / sum(times)),
               loss_last=round(ms[-1].get("loss", float("nan")), 5))
    if cuda:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return row


def lp_compare(rows: list[dict]) -> None:
    """Each variant's log-probs of the fixed samples against the unshared (varlen) variant's, in nats."""
    import torch

    ref_file = os.path.join(WORK, "lp_prefix_unshared.pt")
    if not os.path.exists(ref_file):
        return
    ref = torch.load(ref_file)
    for r in rows:
        f = os.path.join(WORK, f"lp_prefix_{r['name']}.pt")
        if "error" in r or not os.path.exists(f):
            continue
        got = torch.load(f)
        if set(got) != set(ref):
            r["lp_vs_unshared"] = f"different samples: {len(got)} vs {len(ref)}"
            continue
        d = torch.cat([(got[k] - ref[k]).abs() for k in sorted(ref)])
        r["lp_vs_unshared"] = dict(max_abs=round(float(d.max()), 5), mean_abs=round(float(d.mean()), 6), n=int(d.numel()))


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r.get("name") == "unshared" and "error" not in r), None)
    out = ["| variant | attention | tokens/step | micro-batches | step s | samples/s | vs unshared | learner tok/s | "
           "peak GiB (alloc / reserved) | lp vs unshared max / mean |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | {ATTN[r['name']]} | error: {r['error']} |")
            continue
        lp = r.get("lp_vs_unshared")
        lps = f"{lp['max_abs']} / {lp['mean_abs']}" if isinstance(lp, dict) else str(lp or "")
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        out.append(f"| {r['name']} | {r['attn_implementation']} | {r['tokens_per_step']:,} | "
                   f"{'/'.join(map(str, r['micro_batches']))} | {r['step_s']} | {r['samples_per_s']} | {speed} | "
                   f"{r['learner_tok_s']:,} | {r.get('peak_gib')} / {r.get('reserved_peak_gib')} | {lps} |")
    return "\n".join(out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        print("ROW " + json.dumps(run_variant(json.loads(sys.argv[2]))), flush=True)
        return
    t0 = time.perf_counter()
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    import torch
    import transformers

    info.update(torch=torch.__version__, transformers=transformers.__version__,
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    log("ENV " + json.dumps(info))
    model = os.environ.get("MODEL", "smoke" if SMOKE else "1.7B")
    base = dict(model=model, prompts=int(os.environ.get("PROMPTS", "2" if SMOKE else "4")),
                steps=int(os.environ.get("STEPS", "2" if SMOKE else "3")), warmup=int(os.environ.get("WARMUP", "1")),
                mb_tokens=int(os.environ.get("MB_TOKENS", "128" if SMOKE else "32768")),
                gc=os.environ.get("GC", "1") == "1")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "bench.gpu.learner", "--build", model], cwd=REPO, check=True, capture_output=True)
    log(f"built {model} in {time.perf_counter() - t:.1f}s")
    rows = []
    # flex has no backward on CPU (torch raises), so the smoke leaves the flex-only variant out
    for name in os.environ.get("VARIANTS", "unshared,shared" if SMOKE else "unshared,shared,unshared_flex").split(","):
        spec = dict(base, name=name)
        log(f"variant {spec}")
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "bench.gpu.share_prompt", "--variant", json.dumps(spec)], cwd=REPO,
                               timeout=int(os.environ.get("VARIANT_TIMEOUT", "300")), capture_output=True, text=True)
            found = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            for ln in p.stdout.splitlines():
                if ln.startswith("  step"):
                    log("   ", ln.strip())
            row = json.loads(found[-1]) if p.returncode == 0 and found else \
                dict(spec, error=f"rc={p.returncode}", tail=(p.stderr or p.stdout)[-3000:])
        except subprocess.TimeoutExpired as e:
            row = dict(spec, error="timeout", tail=str(e.stderr or "")[-3000:])
        row["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        log("ROWJSON " + json.dumps(row))
        lp_compare(rows)
        json.dump(dict(env=info, rows=rows), open(os.path.join(OUT, "h200_prefix.json"), "w"), indent=1)
    log(table(rows))
    log(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
