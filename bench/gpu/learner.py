"""H200 bench: learner throughput/memory through our Learner (DeepSpeed, +/- liger) and the colocated
sleep/train/sync handshake with CUDA-IPC weight sync between two processes on one GPU.

    python -m bench.gpu.learner                      # MODE=all: learner variants, then the colocated handshake
    MODE=learner VARIANTS=1.7B:0:varlen:lk:16384:nogc python -m bench.gpu.learner
    MODE=colo python -m bench.gpu.learner            # (the colocated half's child: python -m bench.gpu.learner_colo --colo)
    SMOKE=1 python -m bench.gpu.learner              # CPU, tiny shapes: checks the plumbing only

Env: MODE (learner|colo|all), VARIANTS (comma list of model:zero:attn:path[:mbtokens[:nogc|:gc<N>]]; path:
plain, liger (the fused head only) or lk (learner.use_liger as shipped: the head plus the liger
rope/rms_norm/swiglu kernels the Learner applies to its model; before 2026-12-02 evening this script
patched them in itself); "nogc" turns gradient checkpointing off, on by default; "gc14" checkpoints
the first 14 decoder layers only: learner.checkpoint_layers), PROMPTS (groups per
step, 1), STEPS (timed steps, 2), OUT (results dir). Every variant runs in its own process (liger's
kernel patch is process-wide); results: $OUT/h200_learner.json, $OUT/h200_colo.json, one table last.

attn: "varlen" is the Learner's own packed attention (actors/learner/attention.py: torch varlen_attn over the
PackedBatch's cu_seqlens on CUDA, one sdpa per sample on CPU), asked for by name and checked against
per-sample sdpa first; "sdpa" is whatever the Learner picks for sdpa (varlen on a GPU without flash_attn,
the dense mask on CPU); "sdpa_dense" forces the old block-diagonal [1,1,T,T] mask with sdpa's masked
kernel (the slow baseline). Until 2026-12-02 "varlen" was a function registered by this script
("arl_varlen", the same torch varlen_attn kernel); docs/perf/h200.md's rows of that date were measured with it. The log-probs of every variant on the same weights and batch are
compared against the first variant of the same model ("lp_vs_ref"). The shapes, batches, FLOPs and the Learner's
construction it shares with the other GPU benches: bench/gpu/learner_kit.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.gpu.learner_kit import (
    OUT,
    REPO,
    SHAPES,
    SMOKE,
    WORK,
    batch_flops,
    build_model_dir,
    log,
    make_groups,
    make_learner,
    make_train_batch,
    matmul_peak,
    timed_step,
)

# --------------------------------------------------------------------------- one learner variant

def weight_check(learner, mdir: str) -> dict:
    """What export_weights gives (what a generator receives) against the saved checkpoint, plus
    whether lm_head is still tied to the embedding inside the DeepSpeed module."""
    import glob

    import torch
    from safetensors.torch import load_file

    from actors.learner import weights_out

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = {}
    for f in sorted(glob.glob(os.path.join(mdir, "*.safetensors"))):
        ref.update(load_file(f, device=dev))
    got = {n: t for b in learner.export_weights(512, device=dev) for n, t in b}
    m = learner.engine.module.model
    out = dict(tied=m.lm_head.weight is m.model.embed_tokens.weight, exported=len(got), checkpoint=len(ref),
               only_exported=sorted(set(got) - set(ref))[:5], only_checkpoint=sorted(set(ref) - set(got))[:5])
    bad = []
    for n in sorted(set(got) & set(ref)):
        a, b = got[n], ref[n].to(got[n].dtype)
        if a.shape != b.shape or not torch.equal(a, b):
            bad.append(n)
    out["mismatched"] = len(bad)
    out["mismatched_names"] = bad[:5]
    if not out["tied"]:
        lm = [p for n, p in m.named_parameters() if n == "lm_head.weight"]
        if lm:
            with weights_out.gathered(learner, lm):
                e = ref.get("model.embed_tokens.weight")
                out["lm_head_vs_embed_maxabs"] = float((lm[0].detach().to(dev).float() - e.float()).abs().max()) if e is not None else None
    del ref, got
    return out


def run_variant(spec: dict) -> dict:
    import torch

    model, zero, attn, path, mbt = spec["model"], spec["zero"], spec["attn"], spec["path"], spec["mb_tokens"]
    cuda = torch.cuda.is_available()
    row = dict(model=model, zero=zero, attn=attn, path=path, mb_tokens=mbt, gc=spec.get("gc", True))
    peak = matmul_peak()
    row["matmul_tflops"] = round(peak / 1e12, 1) if cuda else None
    learner, info = make_learner(model, zero, attn, path, mbt, gc=row["gc"],
                                 checkpoint_layers=spec.get("checkpoint_layers", -1))
    row["checkpointed_layers"] = learner.checkpointed_layers
    row.update(info)
    kw = SHAPES[model]
    n_params = sum(p.numel() for p in learner.engine.module.parameters())
    if zero == 3:  # partitioned: count from the config
        h, i, L, V = kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"], kw["vocab_size"]
        H, Hkv, hd = kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
        n_params = V * h + L * (h * hd * (H + 2 * Hkv) + H * hd * h + 3 * h * i + 2 * h + 2 * hd) + h
    row["params"] = int(n_params)
    row["weights_vs_checkpoint"] = weight_check(learner, build_model_dir(model))
    prompts = int(os.environ.get("PROMPTS", "1"))
    steps = int(os.environ.get("STEPS", "2"))
    batches = [make_train_batch(make_groups(prompts, kw["vocab_size"], seed=s), mbt, step=s, seed=s) for s in range(steps + 1)]
    # log-probs on fixed sequences before any update (same weights in every variant of this model)
    lp_groups = make_groups(1, kw["vocab_size"], seed=99)
    seqs = [(lp_groups[0][0], c) for c in lp_groups[0][1][:4]]
    with torch.no_grad():
        lps = learner.logprobs(seqs)
    torch.save([x.float() for x in lps], os.path.join(WORK, lp_file(row)))
    if cuda:
        torch.cuda.synchronize()
        row["mem_after_init_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    times, olds, ms = [], [], []
    for i, b in enumerate(batches):
        dt, m = timed_step(learner, b, i)
        if i > 0:  # step 0 is warm-up
            times.append(dt)
            olds.append(m["old_logprob_s"])
            ms.append(m)
    groups_flops = [make_groups(prompts, kw["vocab_size"], seed=s) for s in range(1, steps + 1)]
    tr_f, fw_f, toks = zip(*(batch_flops(g, kw, n_params) for g in groups_flops))
    step_s = sum(times) / len(times)
    old_s = sum(olds) / len(olds)
    T = sum(toks) / len(toks)
    row.update(
        tokens_per_step=int(T), micro_batches=int(ms[-1]["micro_batches"]), step_s=round(step_s, 3),
        old_lp_s=round(old_s, 3), train_s=round(step_s - old_s, 3),
        tok_s_train=round(T / (step_s - old_s)), tok_s_step=round(T / step_s),
        learner_tok_s=round(sum(m["tokens_per_s"] for m in ms) / len(ms)),
    )
    if cuda:
        row["mfu_train"] = round(sum(tr_f) / len(tr_f) / (step_s - old_s) / peak, 3)
        row["mfu_step"] = round((sum(tr_f) + sum(fw_f)) / len(tr_f) / step_s / peak, 3)
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    row["loss_last"] = round(ms[-1].get("loss", float("nan")), 5)
    return row


# --------------------------------------------------------------------------- ZeRO-3 log-prob diagnosis

def run_z3diag(spec: dict) -> dict:
    """Log-probs on the same weights and sequences, long (~4.2k) and short (first 256 tokens), plus
    the rotary inv_freq dtype; with fix_rope the inv_freq buffers are recomputed in fp32 and the
    long log-probs taken again. Saved for the driver to compare ZeRO-0 with ZeRO-3."""
    import torch

    learner, _ = make_learner(spec["model"], spec["zero"], spec["attn"], spec["path"], spec["mb_tokens"])
    kw = SHAPES[spec["model"]]
    g = make_groups(1, kw["vocab_size"], seed=99)
    long = [(g[0][0], c) for c in g[0][1][:4]]
    short = [(g[0][0][:128], c[:128]) for c in g[0][1][:4]]
    row = dict(spec)
    rot = [(n, m) for n, m in learner.engine.module.named_modules() if hasattr(m, "inv_freq")]
    n, m = rot[0]
    cfg = learner.engine.module.model.config
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 1e6)))
    hd = kw["head_dim"]
    ref = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=m.inv_freq.device) / hd))
    row.update(inv_freq_dtype=str(m.inv_freq.dtype), inv_freq_maxrel=float(((m.inv_freq.float() - ref).abs() / ref).max()),
               inv_freq_numel=m.inv_freq.numel(), rotary=n)
    with torch.no_grad():
        out = dict(long=[x.float() for x in learner.logprobs(long)], short=[x.float() for x in learner.logprobs(short)])
        for _, mod in rot:
            mod.inv_freq = ref.clone()
            if hasattr(mod, "original_inv_freq"):
                mod.original_inv_freq = ref.clone()
        out["long_fixed"] = [x.float() for x in learner.logprobs(long)]
    torch.save(out, os.path.join(WORK, f"z3diag_{spec['zero']}.pt"))
    return row


def z3diag_compare() -> dict:
    import torch

    a = torch.load(os.path.join(WORK, "z3diag_0.pt"))
    b = torch.load(os.path.join(WORK, "z3diag_3.pt"))
    res = {}
    for k in ("long", "short", "long_fixed"):
        d = (torch.cat(a[k]) - torch.cat(b[k])).abs()
        res[f"z0_vs_z3_{k}"] = dict(max_abs=round(float(d.max()), 5), mean_abs=round(float(d.mean()), 6))
    d = (torch.cat(a["long"]) - torch.cat(b["long_fixed"])).abs()
    res["z0_vs_z3_fixed_rope"] = dict(max_abs=round(float(d.max()), 5), mean_abs=round(float(d.mean()), 6))
    return res


# --------------------------------------------------------------------------- driver

DEFAULT_VARIANTS = [
    # model:zero:attn:path:mb_tokens ; the first of each model is the log-prob reference (plain head)
    "1.7B:0:varlen:plain:32768",
    "1.7B:0:varlen:lk:32768",
    "1.7B:0:varlen:liger:32768",
    "1.7B:0:varlen:lk:16384",
    "1.7B:3:varlen:lk:32768",
    "1.7B:0:sdpa_dense:plain:32768",
    "1.7B:0:sdpa_dense:lk:16384",
    "0.6B:0:varlen:plain:32768",
    "0.6B:0:varlen:lk:32768",
    "0.6B:3:varlen:lk:32768",
]
SMOKE_VARIANTS = ["smoke:0:varlen:plain:128", "smoke:0:sdpa_dense:plain:128", "smoke:0:sdpa:plain:128", "smoke:3:varlen:liger:64"]


def parse_variant(s: str) -> dict:
    parts = s.split(":")
    model, zero, attn, path = parts[:4]
    mbt = int(parts[4]) if len(parts) > 4 and parts[4] else (32768 if not SMOKE else 128)
    flags = set(parts[5:])
    gc_layers = [f for f in flags if f.startswith("gc") and f[2:].isdigit()]  # gc14: learner.checkpoint_layers=14
    if flags - {"nogc", *gc_layers} or len(gc_layers) > 1:
        raise SystemExit(f"VARIANTS: unknown flag(s) {sorted(flags)} in {s!r}; known: nogc, gc<N> (one)")
    return dict(model=model, zero=int(zero), attn=attn, path=path, mb_tokens=mbt, gc="nogc" not in flags,
                checkpoint_layers=int(gc_layers[0][2:]) if gc_layers else -1)


def child_run(flag: str, spec: dict, timeout: int) -> dict:
    t = time.perf_counter()
    try:
        module = "bench.gpu.learner_colo" if flag == "--colo" else "bench.gpu.learner"  # the colocated child's code is its own module
        p = subprocess.run([sys.executable, "-m", module, flag, json.dumps(spec)], cwd=REPO, timeout=timeout,
                           capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        return dict(spec, error=f"timeout after {timeout}s", tail=(e.stdout or "")[-800:] if isinstance(e.stdout, str) else "")
    rows = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    for ln in p.stdout.splitlines():
        if ln.startswith("  step") or ln.startswith("WARN"):
            log("   ", ln.strip())
    if p.returncode != 0 or not rows:
        return dict(spec, error=f"rc={p.returncode}", tail=(p.stderr or p.stdout)[-1500:])
    row = json.loads(rows[-1])
    row["wall_s"] = round(time.perf_counter() - t, 1)
    return row


def lp_file(r: dict) -> str:
    return f"lp_{r['model']}_{r['zero']}_{r['attn']}_{r['path']}_{r['mb_tokens']}{'' if r.get('gc', True) else '_nogc'}.pt"


def lp_compare(rows):
    import torch

    refs = {}
    for r in rows:
        if "error" in r:
            continue
        f = os.path.join(WORK, lp_file(r))
        if not os.path.exists(f):
            continue
        lp = torch.cat(torch.load(f))
        if r["model"] not in refs:
            refs[r["model"]] = (lp, f"{r['zero']}:{r['attn']}:{r['path']}{'' if r.get('gc', True) else ':nogc'}")
            r["lp_vs_ref"] = "reference"
            continue
        ref, name = refs[r["model"]]
        d = (lp - ref).abs()
        r["lp_vs_ref"] = dict(ref=name, max_abs=round(float(d.max()), 5), mean_abs=round(float(d.mean()), 6), n=int(d.numel()))


def _gc(r: dict) -> str:
    if not r.get("gc", True):
        return "off"
    n = r.get("checkpointed_layers", r.get("checkpoint_layers", -1))
    layers = SHAPES.get(r["model"], {}).get("num_hidden_layers")
    return "on" if n in (-1, None) or n == layers else f"{n}/{layers} layers"


def table(rows):
    out = ["| model | ZeRO | attn | log-prob path | grad ckpt | mb tokens | tokens/step | micro-batches | train tok/s | step tok/s | "
           "MFU train | MFU step | peak GiB | lp vs ref max / mean |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['zero']} | {r['attn']} | {r['path']} | {_gc(r)} | "
                       f"{r['mb_tokens']} | error: {r['error']} |")
            continue
        lp = r.get("lp_vs_ref")
        lps = lp if isinstance(lp, str) else (f"{lp['max_abs']} / {lp['mean_abs']}" if lp else "")
        out.append(f"| {r['model']} | {r['zero']} | {r['attn']} | {r['path']} | {_gc(r)} | "
                   f"{r['mb_tokens']} | {r['tokens_per_step']} | "
                   f"{r['micro_batches']} | {r['tok_s_train']:,} | {r['tok_s_step']:,} | {r.get('mfu_train')} | "
                   f"{r.get('mfu_step')} | {r.get('peak_gib')} | {lps} |")
    return "\n".join(out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] in ("--variant", "--build", "--z3diag"):
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        if sys.argv[1] == "--build":
            print(build_model_dir(sys.argv[2]))
            return
        spec = json.loads(sys.argv[2])
        fn = {"--variant": run_variant, "--z3diag": run_z3diag}[sys.argv[1]]
        row = fn(spec)
        print("ROW " + json.dumps(row), flush=True)
        return
    mode = os.environ.get("MODE", "all")
    t0 = time.perf_counter()
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import torch  # noqa: E401
        import transformers
        info.update(torch=torch.__version__, transformers=transformers.__version__,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
        import importlib.util
        info["flash_attn_installed"] = importlib.util.find_spec("flash_attn") is not None
        for mod in ("deepspeed", "liger_kernel"):
            try:
                from importlib.metadata import version

                __import__(mod)
                info[mod] = version(mod.replace("_", "-"))
            except Exception as e:  # noqa: BLE001
                info[mod] = f"missing ({type(e).__name__})"
    except Exception as e:  # noqa: BLE001
        info["error"] = str(e)
    log("ENV " + json.dumps(info))
    names = os.environ.get("VARIANTS")
    variants = [parse_variant(s) for s in (names.split(",") if names else (SMOKE_VARIANTS if SMOKE else DEFAULT_VARIANTS))]
    budget = float(os.environ.get("BUDGET_S", "1e9"))
    rows = []
    if mode in ("learner", "all"):
        for model in dict.fromkeys(v["model"] for v in variants):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "bench.gpu.learner", "--build", model], cwd=REPO, check=True, capture_output=True)
            log(f"built {model} in {time.perf_counter() - t:.1f}s")
        for v in variants:
            if time.perf_counter() - t0 > budget:
                rows.append(dict(v, error="skipped: time budget"))
                continue
            log(f"variant {v}")
            rows.append(child_run("--variant", v, timeout=int(os.environ.get("VARIANT_TIMEOUT", "240"))))
            log("ROWJSON " + json.dumps(rows[-1]))
            if "error" in rows[-1] and os.environ.get("FAIL_FAST", "1") == "1" and len(rows) == 1:
                # the first variant failing is almost always the plumbing: don't spend device time on the rest
                rows += [dict(v2, error="skipped: the first variant failed") for v2 in variants[1:]]
                break
        lp_compare(rows)
        json.dump(dict(env=info, rows=rows), open(os.path.join(OUT, "h200_learner.json"), "w"), indent=1)
    if mode == "z3diag":
        spec = parse_variant(os.environ.get("Z3DIAG", "smoke:0:varlen:plain:128" if SMOKE else "0.6B:0:varlen:plain:16384"))
        subprocess.run([sys.executable, "-m", "bench.gpu.learner", "--build", spec["model"]], cwd=REPO, check=True, capture_output=True)
        diag = [child_run("--z3diag", dict(spec, zero=z), timeout=200) for z in (0, 3)]
        diag.append(z3diag_compare() if all("error" not in r for r in diag) else {})
        json.dump(diag, open(os.path.join(OUT, "h200_z3diag.json"), "w"), indent=1)
        log("Z3DIAG " + json.dumps(diag, indent=1))
    colo = None
    if mode in ("colo", "all"):
        spec = parse_variant(os.environ.get("COLO", "smoke:0:varlen:plain:128" if SMOKE else "1.7B:0:varlen:lk:16384"))
        spec["lr"] = float(os.environ.get("COLO_LR", "1e-4"))
        spec["offload"] = os.environ.get("COLO_OFFLOAD", "0") == "1"
        subprocess.run([sys.executable, "-m", "bench.gpu.learner", "--build", spec["model"]], cwd=REPO, check=True, capture_output=True)
        log(f"colocated {spec}")
        colo = child_run("--colo", spec, timeout=int(os.environ.get("COLO_TIMEOUT", "300")))
        json.dump(dict(env=info, colo=colo), open(os.path.join(OUT, "h200_colo.json"), "w"), indent=1)
        log("COLO " + json.dumps(colo, indent=1))
    if rows:
        log(table(rows))
    log(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
