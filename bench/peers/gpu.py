"""Us against TRL's GRPOTrainer on one H200, vLLM on both sides, at a generation-heavy shape (issue 30, point 2).

    python3 -m bench.peers.gpu                         # the H200: one call, < 8 minutes (the command below)
    SMOKE=1 .venv/bin/python -m bench.peers.gpu        # CPU: tiny's shape, 2 steps a side (the plumbing)

On the H200, after shared/gpu/device-setup.sh's set-up (vLLM in /tmp/site; Ray, DeepSpeed and the project's
wheels in /tmp/site2) and with `.trl/` carried (bench/peers/gpu_site.sh makes it: TRL and the two packages
the image lacks for it, ~1.7 MB):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl/site-packages .trl/*.whl && \\
    OUT=$OUT python3 -m bench.peers.gpu

What runs, in one process that needs torch and transformers only to build the inputs:
1. the inputs, once, for both sides: RECIPE's task and its model as our launcher builds them
   (launch.inputs.prepare_model_and_data: gpu1_0p6b's synthetic task and its Qwen3-0.6B-shaped model,
   354M parameters, randomly initialised: no warm start fits the call), and the prompts in our coordinator's
   order (bench/peers/ours.py `prompts_in_order`);
2. our run from them: `python -m launch.cluster RECIPE` with model.tiny_sft_steps=0 (the model is reused, not
   rebuilt), STEPS steps of PROMPTS prompts x N samples, MAX_TOKENS new tokens, no evaluation, no
   checkpoint, assembler.filter_zero_variance=false (a random model's groups are mostly all-zero: TRL trains
   them with advantage 0, and ours would otherwise skip them and train less), learner.warmup_ratio=0;
3. TRL's GRPOTrainer from the same model on the same prompts (bench/peers/trl_side.py with spec["vllm"]: TRL's
   vLLM in colocate mode, sleep mode on, the recipe's gpu_memory_utilization, bf16, gradient checkpointing
   as the recipe, the importance-sampling correction truncated at the recipe's correction_cap, MICRO rows
   a forward/backward).
Each side's whole process tree is sampled every 0.5 s (RSS, PSS: bench/peers/tree.py) and the device's memory
every 200 ms (bench/gpu/recipe.py's MemorySampler: nvidia-smi, nothing on CPU). Each side is bounded by
SIDE_TIMEOUT_S and the whole by BUDGET_S: a side that would not fit is skipped and named.

$OUT (rewritten after each side; at most the device tool's 8 files): peers_gpu.md (the table, the ratios, the
differences), peers_gpu.json (every number), ours.console.txt / trl.console.txt (the last 200 kB of each),
ours_mem.csv / trl_mem.csv (device memory samples), ours_metrics.jsonl.

Env: STEPS (5; SMOKE 2), PROMPTS (64; SMOKE 4), N (8; SMOKE 4), MAX_TOKENS (256; SMOKE 16), MICRO (32; SMOKE
the whole step), SEED (0), RECIPE (gpu1_0p6b; SMOKE tiny), SIDES ("ours trl"), SIDE_TIMEOUT_S (225),
BUDGET_S (465), OUT (./bench_out), RUN_ROOT (/tmp/arl-peers-gpu), TRL_PYTHON (the device's python3; SMOKE:
the peer venv's, bench/peers/venv.py), TRL_SITE (/tmp/trl/site-packages when it exists: put first on TRL's PYTHONPATH; its path must hold
"site-packages": dill pickles a module from any other folder by value, and datasets' fingerprint of a
pyarrow so loaded fails with "Can't pickle <class 'MonthDayNano'>"),
TRL_VLLM (1; SMOKE 0: TRL's model.generate on CPU).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.peers import ours, table
from bench.peers.tree import TreeRun, run_tree

REPO = ours.REPO
SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
RECIPE = os.environ.get("RECIPE", "tiny" if SMOKE else "gpu1_0p6b")
STEPS = int(os.environ.get("STEPS", "2" if SMOKE else "5"))
PROMPTS = int(os.environ.get("PROMPTS", "4" if SMOKE else "64"))
N = int(os.environ.get("N", "4" if SMOKE else "8"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "16" if SMOKE else "256"))
MICRO = int(os.environ.get("MICRO", "0" if SMOKE else "32"))
SEED = int(os.environ.get("SEED", "0"))
SIDES = os.environ.get("SIDES", "ours trl").split()
SIDE_TIMEOUT_S = float(os.environ.get("SIDE_TIMEOUT_S", "225"))
BUDGET_S = float(os.environ.get("BUDGET_S", "465"))
OUT = Path(os.environ.get("OUT") or "bench_out").absolute()
RUN_ROOT = Path(os.environ.get("RUN_ROOT", "/tmp/arl-peers-gpu"))
TRL_VLLM = os.environ.get("TRL_VLLM", "0" if SMOKE else "1") not in ("", "0")
T0 = time.time()


def log(msg: str) -> None:
    print(f"[peers.gpu {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def overrides() -> list[str]:
    """Our run's overrides: the shape, no warm start (the shared model), no eval or checkpoint, every group
    trained (as TRL), a constant lr (as TRL's), the seed with the task's seed kept."""
    shape = [f"coordinator.steps={STEPS}", f"coordinator.prompts_per_step={PROMPTS}", f"generator.n_samples={N}",
             f"generator.max_tokens={MAX_TOKENS}"]
    return [*shape, "model.tiny_sft_steps=0", "coordinator.eval_every=0", "coordinator.checkpoint_every=0",
            "assembler.filter_zero_variance=false", "learner.warmup_ratio=0", f"seed={SEED}",
            f"data.synthetic_seed={ours.recipe_config(recipe=RECIPE).data.synthetic_seed}"]


def settings(cfg) -> dict:
    """The settings both sides run with, from the recipe as our run resolves it."""
    g, lr, sc = cfg.generator, cfg.learner, cfg.scorer
    return {"steps": STEPS, "prompts_per_step": PROMPTS, "n_samples": N, "max_tokens": MAX_TOKENS,
            "temperature": g.temperature, "top_p": g.top_p, "lr": lr.lr, "betas": list(lr.betas),
            "weight_decay": lr.weight_decay, "grad_clip": lr.grad_clip, "clip_low": lr.clip_low,
            "clip_high": lr.clip_high, "seed": SEED, "micro_batch": MICRO or PROMPTS * N,
            "gradient_checkpointing": bool(lr.gradient_checkpointing),
            "scorer": {"workers": sc.workers, "timeout_s": sc.timeout_s, "max_rows": sc.max_rows,
                       "memory_mb": sc.memory_mb}}


def vllm_spec(cfg) -> dict | None:
    if not TRL_VLLM:
        return None
    lr = cfg.learner
    return {"gpu_memory_utilization": cfg.generator.gpu_memory_utilization,
            "enable_sleep_mode": cfg.generator.sleep_level > 0,
            "correction_cap": lr.correction_cap if lr.correction == "tis" else None}


def prepare(cfg) -> tuple[Path, list[dict]]:
    """The shared inputs (task data, model) under RUN_ROOT/shared and the prompts in our order."""
    import logging

    from launch.inputs import prepare_model_and_data

    shared = RUN_ROOT / "shared"
    shutil.rmtree(shared, ignore_errors=True)
    prepare_model_and_data(cfg, shared, ours._NullLog(logging.getLogger("bench.peers.gpu")))
    return shared, ours.prompts_in_order(shared, STEPS, overrides(), recipe=RECIPE)


TRL_SITE = "/tmp/trl/site-packages"  # "site-packages" in the path: see TRL_SITE in the docstring


def side_env(trl: bool) -> dict[str, str]:
    from bench.gpu.recipe import device_env

    env = device_env()
    if trl:
        site = os.environ.get("TRL_SITE") or (TRL_SITE if Path(TRL_SITE).is_dir() else "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [site, env.get("PYTHONPATH", "")] if p)
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the carried vLLM has no flashinfer (shared/gpu/VLLM.md)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # TRL sets its single process's world itself (colocate mode)
    return env


def measured(name: str, t: TreeRun, mem: list[tuple[float, float]], samples_per_step: int) -> dict:
    row = {"name": name, "rc": t.rc, "timed_out": t.timed_out, "wall_s": t.wall_s,
           "peak_rss_gb": t.peak_rss_bytes / 1e9, "peak_pss_gb": (t.peak_pss_bytes / 1e9) or None,
           "peak_processes": t.peak_processes, "peak_breakdown": [(n, round(b / 1e6)) for n, b in t.peak_breakdown]}
    if mem:
        row["device_peak_gib"] = round(max(m for _, m in mem) / 1024, 2)
    return row


def end_to_end(row: dict, samples_per_step: int) -> dict:
    """samples_per_s_e2e (STEPS x samples per step over the whole command) only for a side that exited 0 having
    done every step; otherwise None (a side killed after 0 steps has no throughput, not a small one)."""
    done = row.get("rc") == 0 and not row.get("timed_out") and row.get("steps", 0) >= STEPS and row.get("wall_s")
    row["samples_per_s_e2e"] = STEPS * samples_per_step / row["wall_s"] if done else None
    return row


def run_ours(shared: Path, samples_per_step: int, timeout_s: float) -> dict:
    from bench.gpu.recipe import MemorySampler
    from config import layout

    run_dir = RUN_ROOT / "ours"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(layout.model_dir(shared), layout.model_dir(run_dir))
    shutil.copytree(layout.data_dir(shared), layout.data_dir(run_dir))
    cmd = ours.launcher(RUN_ROOT, "ours", overrides(), recipe=RECIPE)
    log(f"ours: {' '.join(cmd[1:])} (timeout {timeout_s:.0f} s)")
    sampler = MemorySampler(OUT / "ours_mem.csv").start()
    t = run_tree(cmd, cwd=REPO, env=side_env(False), log_path=RUN_ROOT / "ours.console", timeout_s=timeout_s)
    mem = sampler.stop()
    row = {**measured(f"arctic-rl {RECIPE} (vLLM, colocated)", t, mem, samples_per_step), "side": "ours",
           "command": " ".join(cmd[1:]), **ours.ours_numbers(run_dir, t.start, samples_per_step)}
    rows = ours.metrics_rows(run_dir)
    row["per_step"] = ours.step_profile(rows)
    row["startup"] = ours.startup_profile(run_dir, t.start, t.spawned)
    if layout.metrics_file(run_dir).exists():
        shutil.copy2(layout.metrics_file(run_dir), OUT / "ours_metrics.jsonl")
    keep_tail(RUN_ROOT / "ours.console", OUT / "ours.console.txt")
    return end_to_end(row, samples_per_step)


def trl_python() -> str:
    if os.environ.get("TRL_PYTHON"):
        return os.environ["TRL_PYTHON"]
    if SMOKE:
        from bench.peers.venv import DEFAULT_VENV, ensure_venv, venv_python

        ensure_venv(DEFAULT_VENV, offline=os.environ.get("PEERS_OFFLINE", "") not in ("", "0"), log=log)
        return str(venv_python(DEFAULT_VENV))
    return sys.executable


def run_trl(shared: Path, prompts: list[dict], cfg, samples_per_step: int, timeout_s: float) -> dict:
    from bench.gpu.recipe import MemorySampler
    from config import layout

    out = RUN_ROOT / "trl"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {"model": str(layout.model_dir(shared)), "out_dir": str(out), "settings": settings(cfg), "prompts": prompts,
            "device": "cpu" if SMOKE else "cuda", "vllm": vllm_spec(cfg)}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [trl_python(), "-P", str(REPO / "bench" / "peers" / "trl_side.py"), str(out / "spec.json")]
    log(f"TRL: {' '.join(cmd)} (timeout {timeout_s:.0f} s)")
    sampler = MemorySampler(OUT / "trl_mem.csv").start()
    t = run_tree(cmd, cwd=out, env=side_env(True), log_path=RUN_ROOT / "trl.console", timeout_s=timeout_s)
    mem = sampler.stop()
    keep_tail(RUN_ROOT / "trl.console", OUT / "trl.console.txt")
    meta_path = out / "trl_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    name = f"TRL {meta.get('versions', {}).get('trl', '?')} GRPOTrainer" + (" (vLLM colocate)" if spec["vllm"] else "")
    row = {**measured(name, t, mem, samples_per_step), "side": "trl", "command": " ".join(cmd), "meta": meta}
    steps_path = out / "trl_steps.jsonl"
    steps = [json.loads(x) for x in steps_path.read_text().splitlines() if x.strip()] if steps_path.exists() else []
    ends = [s["time"] for s in steps if "loss" in s or "reward" in s][:STEPS]
    row.update(ours.timeline(ends, t.start, samples_per_step))
    return end_to_end(row, samples_per_step)


def keep_tail(src: Path, dst: Path, limit: int = 200_000) -> None:
    if src.exists():
        data = src.read_bytes()
        dst.write_bytes(data[-limit:])


COLUMNS = [("samples_per_s_e2e", "samples/s end to end", "{:.1f}"),
           ("samples_per_s_step", "samples/s per step (median)", "{:.1f}"), ("first_step_s", "s to first step", "{:.0f}"), ("s_per_step_median", "s/step (median)", "{:.2f}"),
           ("wall_s", "whole command, s", "{:.0f}"), ("steps", "steps done", "{:.0f}"),
           ("device_peak_gib", "peak device memory (GiB)", "{:.1f}"), ("peak_rss_gb", "peak RSS, process tree (GB)", "{:.2f}")]


def report(rows: list[dict], notes: list[str]) -> str:
    lines = [table.markdown(rows, COLUMNS)]
    peer = next((r for r in rows if r["side"] == "trl"), None)
    mine = next((r for r in rows if r["side"] == "ours"), None)
    if peer and mine:
        def ratio(key: str) -> str:
            a, b = mine.get(key), peer.get(key)
            return f"{a / b:.2f}x" if a is not None and b else "-"
        lines += ["", f"ours / TRL: samples/s end to end {ratio('samples_per_s_e2e')}, per step "
                      f"{ratio('samples_per_s_step')}, peak device memory {ratio('device_peak_gib')}"]
    return "\n".join(lines + ["", "Setup:"] + [f"- {n}" for n in notes])


def notes(cfg) -> list[str]:
    s = settings(cfg)
    return [
        f"{RECIPE}'s task and model ({cfg.model.tiny_layers} layers, hidden {cfg.model.tiny_hidden_size}, vocab "
        f"{cfg.model.tiny_vocab_size}), randomly initialised and shared by both sides; {STEPS} steps of {PROMPTS} prompts "
        f"x {N} samples, {MAX_TOKENS} new tokens, T={s['temperature']}, lr {s['lr']} constant, clip "
        f"{s['clip_low']}/{s['clip_high']}, no KL, seed {SEED}. A random model rarely stops early, so nearly every "
        "sample runs to the token limit on both sides: the shape is generation-heavy by construction, and the held-out "
        "accuracy of a few steps from random weights says nothing (not measured).",
        "Ours: the recipe's vLLM engine (eager, sleep level 2, its gpu_memory_utilization), one DeepSpeed learner rank "
        "(ZeRO-0, bf16, liger, gradient checkpointing, optimizer offload), CUDA-IPC weight sync, TIS at the recipe's cap; "
        "every group trained (assembler.filter_zero_variance=false, as TRL).",
        f"TRL: vLLM colocate in its own process (sleep mode, the same gpu_memory_utilization), bf16, gradient "
        f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, {s['micro_batch']} rows a forward/backward, "
        "the importance-sampling correction token-truncated at the same cap, its weights and AdamW state in bf16 "
        "(loaded with dtype=bfloat16; ours: DeepSpeed's bf16 mode), no optimizer offload; its vLLM runs compiled "
        "with CUDA graphs (TRL has no eager switch), ours eager as the recipe.",
        "End to end: the whole command (start-up, every step, the final save, teardown) divides STEPS x PROMPTS x N "
        "samples; per step: samples over the median time between consecutive steps' ends.",
    ]


def write(result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peers_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    (OUT / "peers_gpu.md").write_text(result["text"] + "\n")


def main() -> int:
    from observe.logs import quiet_cpu_host

    quiet_cpu_host()  # no DeepSpeed accelerator warning on stdout where there is no GPU (the table is stdout's)
    OUT.mkdir(parents=True, exist_ok=True)
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    cfg = ours.recipe_config(overrides(), recipe=RECIPE)
    samples_per_step = PROMPTS * N
    shared, prompts = prepare(cfg)
    log(f"inputs ready: {len(prompts)} prompts, model {shared / 'model'}")
    result = {"recipe": RECIPE, "smoke": SMOKE, "settings": settings(cfg), "rows": [], "skipped": [],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for side in SIDES:
        left = BUDGET_S - (time.time() - T0)
        if left < 60:
            result["skipped"].append(f"{side}: {left:.0f} s of BUDGET_S left")
            log(f"skipped {side}: {left:.0f} s left")
            continue
        timeout = min(SIDE_TIMEOUT_S, left)
        row = (run_ours(shared, samples_per_step, timeout) if side == "ours"
               else run_trl(shared, prompts, cfg, samples_per_step, timeout))
        log(f"{side}: rc {row['rc']}, {row['wall_s']:.0f} s, {row.get('steps', 0):.0f} steps")
        result["rows"].append(row)
        result["text"] = report(result["rows"], notes(cfg) + [f"skipped: {s}" for s in result["skipped"]])
        write(result)
    result["text"] = report(result["rows"], notes(cfg) + [f"skipped: {s}" for s in result["skipped"]])
    write(result)
    print(result["text"])
    return 0 if result["rows"] and all(r["rc"] == 0 for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
