"""Which supervised warm start leaves gpu1_0p6b's model where GRPO can climb? A sweep on one GPU (issue 25).

    .venv/bin/python -m bench.gpu.warm_start --prepare runs/warm_task [--seed S] [key=value ...]   # CPU, the project's venv
    TASK=runs/warm_task BUDGET_S=500 OUT=$OUT PYTHONPATH=$PWD python3 -m bench.gpu.warm_start     # the device
    SMOKE=1 .venv/bin/python -m bench.gpu.warm_start                 # CPU: a tiny shape, 5 steps, 2 configs

Two halves, because the device has torch, transformers, tokenizers and numpy but none of the project's
other dependencies (config, tasks.bird and queues.messages all import msgspec, a compiled package):
- `--prepare DIR` (anywhere the project's venv is) writes the task pack (bench/gpu/warm_task.py): the run's
  databases, tokenizer, prompts and warm-start pairs, built by the launcher's own functions. ~1.5 MB.
- The sweep (TASK=DIR) builds the recipe's model with tasks.tiny_model.build_model (the run's init,
  same seed), then for each trajectory of the grid trains from that init with plain torch and
  evaluates at its checkpoints. Where TASK has no pack and msgspec imports (CPU), it prepares one first.

Invariants:
- The sweep imports only torch, transformers, tokenizers, the standard library and project modules
  that import nothing else (bench.gpu.warm_task's load_task, launch.warm_start, tasks.tiny_model,
  tasks.sandbox, tasks.synthetic, policies.sql_reward); tests/integration/test_gpu_warm_start.py runs it with
  msgspec, ray, redis, deepspeed, structlog, pydantic, accelerate and psutil hidden from imports.
- Draws are the warm start's: launch.warm_start.step_draws with random.Random(seed), the batch and the
  slip share, so the first N steps of a constant-lr trajectory ARE an N-step warm start: one trajectory
  evaluated at 200, 400 and 800 steps measures three warm starts. (A cosine trajectory's checkpoints
  before its end are mid-schedule, not shorter warm starts: its rows say so.)
- Numerics as the learner's (DeepSpeed bf16 at ZeRO-0): bf16 parameters and activations, fp32 master
  weights and AdamW moments (the recipe's betas and weight decay), the global grad norm of the fp32
  gradients clipped to learner.grad_clip, CE as the token-mean over all target tokens of the step, the
  rotary inv_freq kept in fp32 (actors/learner/logprob_head.restore_rotary_buffers). PRECISION=fp32
  (SMOKE's default) trains fp32 parameters directly.
- Evaluation as the run's: every held-out prompt, greedy (eval_accuracy) and data.eval_samples samples at
  generator.temperature, top-k/top-p off (eval_reward_mean, eval_sample_accuracy), generator.max_tokens new
  tokens, each group scored by tasks.sandbox.score_group in a SqlPool with the recipe's scorer limits;
  and greedy on training prompts (train_accuracy). HF generate stands in for vLLM (same bf16 weights).
- Budget: a segment (training to the next checkpoint and its evaluation) starts only if its estimate
  fits BUDGET_S; $OUT/warm_sweep.json and warm_sweep.md are rewritten after every evaluation, so a
  call cut short still leaves every row it finished.

Env: TASK (runs/warm_task), OUT (./bench_out), BUDGET_S (500: seconds from the model's build on),
SEED (the pack's: the model's init and the draws; the data are the pack's), PRECISION (bf16 on CUDA, else
fp32), ONLY (comma-separated trajectory names), STEPS (e.g. 400,800,1600: the constant trajectories'
checkpoints), EVAL_LIMIT / TRAIN_EVAL_LIMIT (prompts; 0 = all), SMOKE=1 (a 2-layer 64-wide shape,
checkpoints at 2 and 5 steps, 2 trajectories, 12 prompts), CALIBRATE=1 (tiny's own shape and warm start,
150 and 300 steps at 3e-3, fp32: to hold the bench against the launcher's warm-start figures in
docs/perf/tiny.md, held-out greedy 0.09-0.15 and reward 0.17-0.21 with 4 samples; ~20 s on the H200).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from bench.gpu.warm_task import SMALL_SHAPE, load_task, prepare

SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
CALIBRATE = os.environ.get("CALIBRATE", "") not in ("", "0")


@dataclass(frozen=True)
class Trajectory:
    """One warm start trained once and evaluated at each of `checkpoints` (steps)."""
    name: str
    lr: float
    slip: float
    batch: int = 16
    schedule: str = "constant"  # or "cosine": 5 % linear warm-up, cosine to 10 % of lr at the last checkpoint
    checkpoints: tuple[int, ...] = (200, 400, 800)


# Most informative first: the recipe's own warm start (its 200-step point is the device run's 0.027
# greedy, so it checks this bench against the run) and where more steps take it; then the lr, the slip
# share, a 4x batch (more distinct prompts a step), both changes at once, and a warmed-up higher lr.
GRID = [
    Trajectory("recipe_lr3e-4_slip0.6", 3e-4, 0.6),
    Trajectory("lr1e-3_slip0.6", 1e-3, 0.6),
    Trajectory("lr1e-3_slip0.3", 1e-3, 0.3),
    Trajectory("lr1e-3_slip0.5", 1e-3, 0.5),
    Trajectory("lr1e-3_slip0.6_b64", 1e-3, 0.6, batch=64, checkpoints=(200, 400)),
    Trajectory("lr3e-4_slip0.3", 3e-4, 0.3),
    Trajectory("lr2e-3_cos_slip0.45", 2e-3, 0.45, schedule="cosine", checkpoints=(400, 800)),
]
SMOKE_GRID = [Trajectory("smoke_a", 3e-3, 0.6, batch=4, checkpoints=(2, 5)),
              Trajectory("smoke_b", 3e-3, 0.3, batch=4, schedule="cosine", checkpoints=(5,))]
SMOKE_SHAPE = SMALL_SHAPE


# --------------------------------------------------------------------------------------------- the model

def build_init(task: dict, shape: dict, seed: int):
    """(a random-init model of `shape` on the CPU in fp32, the task's tokenizer): tasks.tiny_model.build_model."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tasks.tiny_model import build_model

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(task["tokenizer"])
    with tempfile.TemporaryDirectory() as tmp:  # build_model saves what it builds, as the launcher needs
        model = build_model(SimpleNamespace(**shape), tok, tmp, seed=seed)
    return model, tok


class Trainer:
    """The trajectory's model (bf16 or fp32 on `device`), fp32 masters, AdamW: one sft step at a time."""

    def __init__(self, init, learner: dict, device, dtype):
        import torch

        self.torch, self.device, self.dtype = torch, device, dtype
        rotary = {n: b.clone() for n, b in init.named_buffers() if n.endswith("inv_freq")}
        self.model = init.to(device=device, dtype=dtype)
        for n, b in rotary.items():  # fp32 RoPE, as the learner's restore_rotary_buffers
            mod, _, attr = n.rpartition(".")
            setattr(self.model.get_submodule(mod), attr, b.to(device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = (self.params if dtype == torch.float32
                        else [p.detach().float().clone().requires_grad_(True) for p in self.params])
        lc = learner
        self.clip = lc["grad_clip"]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-3, betas=tuple(lc["betas"]), weight_decay=lc["weight_decay"],
                                     fused=device.type == "cuda")

    def step(self, chunk: list[tuple[list[int], list[int]]], lr: float) -> float:
        """Token-mean CE on the targets of `chunk` (prompt, target) pairs, one optimizer step at `lr`."""
        torch = self.torch
        seqs = [p + t for p, t in chunk]
        width = max(len(s) for s in seqs) - 1
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        labels = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width)
        for i, ((p, t), s) in enumerate(zip(chunk, seqs)):
            ids[i, :len(s) - 1] = torch.tensor(s[:-1])
            labels[i, :len(s) - 1] = torch.tensor(s[1:])
            mask[i, len(p) - 1:len(s) - 1] = 1.0  # right padding: causal attention never sees it
        ids, labels, mask = ids.to(self.device), labels.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        if self.masters is not self.params:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
                p.grad = None
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)  # round to bf16, as the bf16 optimizer hands the model its weights
        return float(loss.detach())


def lr_at(t: Trajectory, step: int) -> float:
    """The trajectory's lr at `step` (0-based): constant, or 5 % warm-up then cosine to 10 % at its end."""
    if t.schedule == "constant":
        return t.lr
    total = t.checkpoints[-1]
    warm = max(1, math.ceil(0.05 * total))
    if step < warm:
        return t.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# --------------------------------------------------------------------------------------------- evaluation

def generate(model, tok, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, rows: int) -> list[list[str]]:
    """n completions per prompt (greedy when temperature is 0), left-padded batches of <= `rows` rows."""
    import torch

    out: list[list[str]] = []
    per = max(1, rows // n)
    pad = tok.pad_token_id
    for s in range(0, len(prompts), per):
        chunk = prompts[s:s + per]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_tokens, num_return_sequences=n,
                                 eos_token_id=tok.eos_token_id, pad_token_id=pad, **kw)
        texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        out += [texts[i * n:(i + 1) * n] for i in range(len(chunk))]
    return out


def score(items: list[dict], texts: list[list[str]], scorer: dict, pool_box: dict) -> list:
    """tasks.sandbox.score_group of every item's completions (the run's scorer, its limits)."""
    from tasks.sandbox import GoldCache, score_group
    from tasks.sql_pool import SqlPool

    if "pool" not in pool_box:
        pool_box["pool"] = SqlPool(workers=scorer["workers"], timeout_s=scorer["timeout_s"], memory_mb=scorer["memory_mb"])
        pool_box["gold"] = GoldCache()

    async def run():
        return await asyncio.gather(*(score_group(pool_box["pool"], it["db"], it["gold_sql"], t, pool_box["gold"])
                                      for it, t in zip(items, texts)))
    return asyncio.run(run())


def evaluate(model, tok, task: dict, held: list[dict], train: list[dict], pool_box: dict, seed: int) -> dict:
    """The run's held-out figures (greedy, sampled) and greedy accuracy on training prompts."""
    import torch

    from policies.sql_reward import extract_sql
    from tasks.synthetic_text import slipped

    g = task["generator"]
    model.eval()
    greedy = generate(model, tok, [it["prompt"] for it in held], 1, g["max_tokens"], 0.0, 256)
    gs = score(held, greedy, task["scorer"], pool_box)
    torch.manual_seed(seed)
    n = 2 if SMOKE else g["eval_samples"]
    sampled = generate(model, tok, [it["prompt"] for it in held], n, g["max_tokens"], g["temperature"], 1024)
    ss = score(held, sampled, task["scorer"], pool_box)
    tg = score(train, generate(model, tok, [it["prompt"] for it in train], 1, g["max_tokens"], 0.0, 256),
               task["scorer"], pool_box)
    model.train()
    verdicts = [s.verdicts[0] for s in gs]
    rewards = [r for s in ss for r in s.rewards]
    return {"eval_accuracy": sum(v == "match" for v in verdicts) / max(1, len(held)),
            "eval_valid_sql": sum(v in ("match", "wrong_result") for v in verdicts) / max(1, len(held)),
            "eval_greedy_slip": sum(extract_sql(t[0]) == slipped(it["gold_sql"]) for it, t in zip(held, greedy))
            / max(1, len(held)),
            "eval_reward_mean": sum(rewards) / max(1, len(rewards)),
            "eval_sample_accuracy": sum(v == "match" for s in ss for v in s.verdicts) / max(1, len(rewards)),
            "train_accuracy": sum(s.verdicts[0] == "match" for s in tg) / max(1, len(train)),
            "example": greedy[0][0][:160] if greedy else ""}


# --------------------------------------------------------------------------------------------- the sweep

def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cols = ("trajectory", "steps", "lr", "slip", "batch", "schedule", "sft_loss", "eval_accuracy", "eval_reward_mean",
            "eval_sample_accuracy", "eval_greedy_slip", "eval_valid_sql", "train_accuracy", "train_s", "wall_s")
    lines = [f"# gpu_warm_start: {meta['recipe']}-shaped model, seed {meta['seed']}, {meta['device']}, {meta['precision']}",
             "", f"{meta['held_out']} held-out prompts (greedy + {meta['eval_samples']} samples at T={meta['temperature']}),"
             f" {meta['train_eval']} training prompts greedy; sft_loss: mean of the last 10 steps; train_s: training "
             f"seconds to this checkpoint; {meta['note']}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |" for r in rows]
    if meta.get("skipped"):
        lines += ["", "Not run (budget): " + ", ".join(meta["skipped"])]
    (out / "warm_sweep.md").write_text("\n".join(lines) + "\n")


def setting(task: dict) -> tuple[str, dict, dict, list[Trajectory]]:
    """(name, model shape, learner settings, grid) of this process: SMOKE, CALIBRATE or the recipe's sweep."""
    if SMOKE:
        return "smoke", dict(task["model"], **SMOKE_SHAPE), task["learner"], SMOKE_GRID
    if CALIBRATE:  # tiny's own warm start, to hold this bench against the launcher's (docs/perf/tiny.md)
        t = task["tiny"]
        steps = t["sft_steps"]
        return "tiny (calibration)", t["model"], t["learner"], [
            Trajectory("tiny_recipe", t["sft_lr"], t["sft_slip"], checkpoints=(steps // 2, steps))]
    steps = tuple(int(x) for x in os.environ.get("STEPS", "").split(",") if x)
    grid = [Trajectory(t.name, t.lr, t.slip, t.batch, t.schedule, steps) if steps and t.schedule == "constant" else t
            for t in GRID]
    return task["recipe"], task["model"], task["learner"], grid


def sweep(task: dict, grid: list[Trajectory], out: Path, budget_s: float, seed: int) -> list[dict]:
    import torch

    from launch.warm_start import step_draws

    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = os.environ.get("PRECISION") or ("bf16" if device.type == "cuda" and not (SMOKE or CALIBRATE) else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    name, shape, learner, _ = setting(task)
    init, tok = build_init(task, shape, seed)
    init_state = {k: v.clone() for k, v in init.state_dict().items()}
    limit = int(os.environ.get("EVAL_LIMIT", "12" if SMOKE else "0")) or None
    held = task["eval"][:limit]
    train = task["train"][:int(os.environ.get("TRAIN_EVAL_LIMIT", "12" if SMOKE else "0")) or None]
    pairs = task["pairs"]
    meta = {"recipe": name, "seed": seed, "device": torch.cuda.get_device_name() if device.type == "cuda"
            else "cpu", "precision": precision, "held_out": len(held), "train_eval": len(train),
            "eval_samples": 2 if SMOKE else task["generator"]["eval_samples"],
            "temperature": task["generator"]["temperature"], "recipe_sft": task["sft"], "recipe_rl_lr": task["learner"]["lr"],
            "overrides": task.get("overrides", []),
            "params": sum(p.numel() for p in init.parameters()), "budget_s": budget_s, "skipped": [],
            "note": "cosine rows before their last checkpoint are mid-schedule."}
    print(f"gpu_warm_start: {meta['params'] / 1e6:.1f}M params, {len(pairs)} pairs, {len(held)} held-out, "
          f"{precision} on {meta['device']}, build {time.monotonic() - t0:.1f} s", flush=True)
    rows: list[dict] = []
    pool_box: dict = {}
    step_s, eval_s = (0.25, 30.0) if device.type == "cuda" else (1.0, 30.0)  # priors until measured
    try:
        for t in grid:
            done, losses, train_s = 0, [], 0.0
            trainer = None
            for ck in t.checkpoints:
                need = (ck - done) * step_s * (t.batch / 16) + eval_s
                if time.monotonic() - t0 + need > budget_s:
                    meta["skipped"].append(f"{t.name}@{ck} (needs ~{need:.0f} s)")
                    print(f"skip {t.name} at {ck} steps: ~{need:.0f} s left to need, "
                          f"{budget_s - (time.monotonic() - t0):.0f} s left", flush=True)
                    break
                if trainer is None:
                    init.load_state_dict(init_state)
                    trainer = Trainer(init, learner, device, dtype)
                    rng = random.Random(seed)
                s0 = time.monotonic()
                for i in range(done, ck):
                    chunk = [(pairs[k][0], pairs[k][2] if use_slip else pairs[k][1])
                             for k, use_slip in step_draws(pairs, rng, t.batch, t.slip)]
                    losses.append(trainer.step(chunk, lr_at(t, i)))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seg = time.monotonic() - s0
                train_s += seg
                step_s = seg / max(1, ck - done) / (t.batch / 16)
                done = ck
                e0 = time.monotonic()
                figures = evaluate(trainer.model, tok, task, held, train, pool_box, seed)
                eval_s = max(eval_s if rows else 0.0, time.monotonic() - e0)
                row = {"trajectory": t.name, "steps": ck, "lr": t.lr, "slip": t.slip, "batch": t.batch,
                       "schedule": t.schedule if t.schedule == "constant" or ck == t.checkpoints[-1] else "cosine-mid",
                       "sft_loss": sum(losses[-10:]) / len(losses[-10:]), "sft_loss_first": losses[0],
                       **figures, "train_s": round(train_s, 1), "eval_s": round(time.monotonic() - e0, 1),
                       "wall_s": round(time.monotonic() - t0, 1)}
                rows.append(row)
                write(out, meta, rows)
                print(f"{t.name:>24} @{ck:>4}: loss {row['sft_loss']:.3f}  held-out greedy {row['eval_accuracy']:.3f} "
                      f"(slip {row['eval_greedy_slip']:.2f})  sampled reward {row['eval_reward_mean']:.3f} "
                      f"(acc {row['eval_sample_accuracy']:.3f})  train greedy {row['train_accuracy']:.3f}  "
                      f"{train_s:.0f}+{row['eval_s']:.0f} s  [{row['wall_s']:.0f} s]", flush=True)
            if trainer is not None:
                init = trainer.model.to("cpu", dtype=torch.float32)  # the module object, reloaded from init_state
                del trainer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if "pool" in pool_box:
            pool_box["pool"].close()
        write(out, meta, rows)
    return rows


def main(argv: list[str]) -> int:
    task_dir = Path(os.environ.get("TASK") or ("runs/warm_task_smoke" if SMOKE else "runs/warm_task"))
    if argv[:1] == ["--prepare"]:
        rest, seed = argv[2:], None
        if rest[:1] == ["--seed"] and len(rest) >= 2:
            seed, rest = int(rest[1]), rest[2:]
        if len(argv) < 2 or any("=" not in a for a in rest):
            sys.exit("usage: python -m bench.gpu.warm_start --prepare DIR [--seed S] [key=value ...]")
        path = prepare(Path(argv[1]), seed, overrides=rest)
        print(f"task pack: {path} ({sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
        return 0
    task = load_task(task_dir)
    seed = int(os.environ.get("SEED", task["seed"]))
    only = [s for s in os.environ.get("ONLY", "").split(",") if s]
    full = setting(task)[3]
    grid = [t for t in full if not only or t.name in only]
    if not grid:
        sys.exit(f"error: ONLY={','.join(only)} names no trajectory; known: {', '.join(t.name for t in full)}")
    out = Path(os.environ.get("OUT") or "bench_out").absolute()
    rows = sweep(task, grid, out, float(os.environ.get("BUDGET_S", "500")), seed)
    print(f"wrote {out / 'warm_sweep.md'} ({len(rows)} rows)")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
