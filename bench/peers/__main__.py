"""Us against TRL's GRPOTrainer on tiny's task, the same start, prompts, reward and settings, back to back.

    nice -n 10 .venv/bin/python -m bench.peers                 # 60 steps, both sides; table on stdout
    SMOKE=1 .venv/bin/python -m bench.peers                    # 3 steps, 20 warm-start steps, 8 held-out prompts
    SIDES=ours .venv/bin/python -m bench.peers                 # our side only (no peer venv)
    SEEDS="0 1 2" nice -n 10 .venv/bin/python -m bench.peers    # one export, then both sides once per seed

What runs, in order (each command a child process whose whole process tree's RSS is sampled every
0.5 s, bench/peers/tree.py):
1. the peer venv (bench/peers/venv.py: TRL beside torch==2.13.0; PEERS_OFFLINE=1: local sources only);
2. the warm-started export, once per $OUT (a later command with the same OUT reuses it), through our
   launcher (bench/peers/ours.py: tiny's warm start, then one step at lr 1e-30), given to both sides;
3. our run(s) from it: `tiny` as is (held-out evals every 10 steps) and, unless SMOKE, with
   coordinator.eval_every=0 (the training loop alone) and in async mode at staleness 1 (PEERS_ASYNC_ROW=0:
   not); the project's sources byte-compiled first, as on any machine after its first run (TRL's venv is
   compiled by pip; this one may run with PYTHONDONTWRITEBYTECODE);
4. TRL's GRPOTrainer from the same export on the same prompts in the same order (bench/peers/trl_side.py);
5. the same `launch.eval` on every final model over the held-out split: greedy (EX by BIRD's rule and
   strict) and 4 samples at T=1 (the mean training reward of those samples, our reward code).
Writes $OUT/peers.json (every number, the start-up and per-step profiles of our run) and $OUT/peers.md
(the table, the differences, the profile); prints the table. Env: STEPS, OUT, SIDES ("ours trl"), SMOKE,
PEERS_OFFLINE (build the peer venv from local sources only), PEERS_TRL_THREADS (TRL's OMP_NUM_THREADS, 1),
PEERS_NO_EVAL_ROW=0 (leave out our coordinator.eval_every=0 row), SEEDS (RL seeds run from the one export,
each side once per seed, in turn: our `seed=S` (data.synthetic_seed kept: the export's task), TRL's seed S;
empty: the recipe's seed; the table per seed, then the means over seeds).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import ours, table
from bench.peers.tree import TreeRun, run_tree
from bench.peers.venv import DEFAULT_VENV, PeerVenvUnavailable, ensure_venv, venv_python

REPO = ours.REPO
SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
STEPS = int(os.environ.get("STEPS", "3" if SMOKE else "60"))
SIDES = os.environ.get("SIDES", "ours trl").split()
EVAL_SAMPLES = 2 if SMOKE else 4
EVAL_LIMIT = 8 if SMOKE else 0
SMOKE_SFT = 20
TIMEOUT_S = 3600.0
# Intra-op threads of TRL's process. Our launcher gives each actor OMP_NUM_THREADS=1; on a shared, loaded
# machine torch's default (one thread per core) makes every parallel op wait for a descheduled thread.
TRL_THREADS = os.environ.get("PEERS_TRL_THREADS", "1")
SEEDS: list[int | None] = [int(x) for x in os.environ.get("SEEDS", "").split()] or [None]


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


ASYNC = ["coordinator.mode=async", "assembler.max_staleness=1"]


def our_variants() -> list[tuple[str, list[str]]]:
    rows = [("arctic-rl tiny (evals every 10 steps, as the recipe)", [])]
    if not SMOKE and os.environ.get("PEERS_NO_EVAL_ROW", "1") not in ("", "0"):
        rows.append(("arctic-rl tiny, coordinator.eval_every=0", ["coordinator.eval_every=0"]))
    if not SMOKE and os.environ.get("PEERS_ASYNC_ROW", "1") not in ("", "0"):
        rows.append(("arctic-rl tiny, " + " ".join(ASYNC) + " (evals every 10 steps)", list(ASYNC)))
    return rows


def seed_overrides(seed: int | None) -> list[str]:
    """Our run's overrides for an RL seed: `seed=S` with the task's seed kept (the export's data)."""
    if seed is None:
        return []
    return [f"seed={seed}", f"data.synthetic_seed={ours.recipe_config().data.synthetic_seed}"]


def seed_tag(seed: int | None) -> str:
    return "" if seed is None else f"s{seed}"


def settings(steps: int, seed: int | None = None) -> dict:
    cfg = ours.recipe_config(seed_overrides(seed))
    g, lr, sc = cfg.generator, cfg.learner, cfg.scorer
    return {"steps": steps, "prompts_per_step": cfg.coordinator.prompts_per_step, "n_samples": g.n_samples,
            "max_tokens": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p, "lr": lr.lr,
            "betas": list(lr.betas), "weight_decay": lr.weight_decay, "grad_clip": lr.grad_clip,
            "clip_low": lr.clip_low, "clip_high": lr.clip_high, "seed": cfg.seed,
            "scorer": {"workers": sc.workers, "timeout_s": sc.timeout_s, "max_rows": sc.max_rows,
                       "memory_mb": sc.memory_mb}}


def after_last_step(t: TreeRun, row: dict) -> dict:
    """Seconds from the last step's end to the command's exit (the run's end: export, teardown)."""
    if row.get("first_step_s") is None:
        return {}
    return {"after_last_step_s": t.wall_s - row["first_step_s"] - row["loop_s"]}


def tree_fields(t: TreeRun, samples: int) -> dict:
    return {"wall_s": t.wall_s, "rc": t.rc, "peak_rss_gb": t.peak_rss_bytes / 1e9,
            "peak_pss_gb": t.peak_pss_bytes / 1e9 or None, "peak_processes": t.peak_processes,
            "max_processes": t.max_processes, "samples_per_s_e2e": samples / t.wall_s if t.wall_s else None,
            "peak_at_s": t.peak_at_s, "peak_breakdown": [(n, round(b / 1e6)) for n, b in t.peak_breakdown]}


def check(t: TreeRun, what: str, log_path: Path) -> None:
    if t.rc != 0:
        tail = log_path.read_text().strip().splitlines()[-3:] if log_path.exists() else []
        raise SystemExit(f"error: {what} exited {t.rc}{' (timed out)' if t.timed_out else ''}; "
                         f"see {log_path}: {' | '.join(tail)[:400]}")


# -- the sides ------------------------------------------------------------------------------------


def make_export(root: Path) -> dict:
    """The warm-started export, made once per $OUT: a later command with the same OUT (an earlier run's
    runs/warm/hf/step_1 and its export.json there) starts from it again rather than spending the warm start anew."""
    saved, sft = root / "export.json", SMOKE_SFT if SMOKE else None
    if ours.warm_export(root).is_dir() and saved.exists() and json.loads(saved.read_text()).get("sft_steps") == sft:
        log(f"warm start + export: reusing {ours.warm_export(root)} (delete {root / 'warm'} to make it again)")
        return {**json.loads(saved.read_text()), "reused": True}
    cmd = ours.export_command(root, sft)
    log(f"warm start + export: {' '.join(cmd[1:])}")
    t = run_tree(cmd, cwd=REPO, log_path=root / "warm.console", timeout_s=TIMEOUT_S)
    check(t, "the warm-start export run", root / "warm.console")
    made = {"sft_steps": sft, "wall_s": t.wall_s, "startup": ours.startup_profile(root / "warm", t.start, t.spawned),
            "peak_rss_gb": t.peak_rss_bytes / 1e9, "peak_processes": t.peak_processes}
    saved.write_text(json.dumps(made))
    return made


def run_ours(root: Path, name: str, extra: list[str], i: int, samples_per_step: int, seed: int | None = None) -> dict:
    run_id = f"ours{i}{seed_tag(seed)}"
    run_dir = ours.prepare_run_dir(root, run_id)
    cmd = ours.run_command(root, run_id, STEPS, extra)
    log(f"{name}: {' '.join(cmd[1:])}")
    console = root / f"{run_id}.console"
    t = run_tree(cmd, cwd=REPO, log_path=console, timeout_s=TIMEOUT_S)
    check(t, name, console)
    row = {"name": name, "side": "ours", "seed": seed, "command": " ".join(cmd[1:]), **tree_fields(t, STEPS * samples_per_step),
           **ours.ours_numbers(run_dir, t.start, samples_per_step)}
    rows = ours.metrics_rows(run_dir)
    row.update(after_last_step(t, row))
    row["prompts_trained"] = sum(int(r.get("prompts_trained") or 0) for r in rows if r.get("step", -1) >= 0)
    row["startup"] = ours.startup_profile(run_dir, t.start, t.spawned)
    row["per_step"] = ours.step_profile(rows)
    row["spawned"] = t.spawned
    row["model"] = str(ours.final_export(run_dir))
    return row


def run_trl(root: Path, venv: Path, samples_per_step: int, seed: int | None = None) -> dict:
    out = root / f"trl{seed_tag(seed)}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(ours.warm_export(root)), "out_dir": str(out), "settings": settings(STEPS, seed),
            "prompts": ours.prompts_in_order(root / "warm", STEPS)}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(venv_python(venv)), "-P", str(REPO / "bench" / "peers" / "trl_side.py"), str(spec_path)]
    # no torch.distributed world of the caller's (a RANK/WORLD_SIZE left in a test process made TRL's
    # accelerate ask for MASTER_ADDR): TRL runs as the single process it is
    dist = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in dist and not k.startswith("ACCELERATE_")}
    env["OMP_NUM_THREADS"] = TRL_THREADS  # as every one of our actors (launch/local_ray.py run_env's default)
    log(f"TRL GRPOTrainer: {' '.join(cmd)}")
    console = root / f"trl{seed_tag(seed)}.console"
    t = run_tree(cmd, cwd=out, env=env, log_path=console, timeout_s=TIMEOUT_S)
    check(t, "the TRL side", console)
    meta = json.loads((out / "trl_meta.json").read_text())
    steps = [json.loads(x) for x in (out / "trl_steps.jsonl").read_text().splitlines() if x.strip()]
    ends = [s["time"] for s in steps if "loss" in s or "reward" in s][:STEPS]
    row = {"name": f"TRL {meta['versions']['trl']} GRPOTrainer" + ("" if seed is None else f" (seed {seed})"),
           "side": "trl", "seed": seed, "command": " ".join(cmd),
           **tree_fields(t, STEPS * samples_per_step), **ours.timeline(ends, t.start, samples_per_step),
           "meta": meta, "model": str(out / "final"),
           "startup": ours.with_gaps([{"at_s": round(meta[k] - t.start, 2), "what": w, "source": "trl_meta.json"} for k, w in (
               ("t_imported", "torch, transformers, trl imported"), ("t_loaded", "model and tokenizer loaded"),
               ("t_ready", "GRPOTrainer built"), ("t_trained", "train() returned"), ("t_saved", "model saved"))]
                                     + ([{"at_s": round(ends[0] - t.start, 2), "what": "first step done",
                                          "source": "trl_steps.jsonl"}] if ends else []))}
    row.update(after_last_step(t, row))
    return row


# -- held-out evaluation ------------------------------------------------------------------------


def evaluate(model: str, bird_dir: Path, out: Path) -> dict:
    """launch.eval greedy and sampled over the held-out split; the numbers of the table."""
    import subprocess

    base = [sys.executable, "-m", "launch.eval", "--model", model, "--bird-dir", str(bird_dir), "--split", "dev"]
    if EVAL_LIMIT:
        base += ["--limit", str(EVAL_LIMIT)]
    res = {}
    for tag, extra in (("greedy", []), ("sampled", ["--samples", str(EVAL_SAMPLES)])):
        d = out / tag
        p = subprocess.run([*base, "--out-dir", str(d), *extra], cwd=REPO, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise SystemExit(f"error: launch.eval ({tag}) on {model} exited {p.returncode}: {p.stderr.strip()[-400:]}")
        res[tag] = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines() if x.strip()]
    g = res["greedy"]
    return {"ex_greedy": sum(r["ex_bird"] for r in g) / len(g), "ex_greedy_strict": sum(r["ex_strict"] for r in g) / len(g),
            "sampled_reward": sampled_reward(res["sampled"], bird_dir), "eval_questions": len(g)}


def sampled_reward(rows: list[dict], bird_dir: Path) -> float:
    """Mean training reward of every sampled answer (our reward code: tasks.sandbox.score_group)."""
    import asyncio

    from tasks.bird import load_split
    from tasks.sandbox import GoldCache, SqlPool, score_group

    by_id = {q.question_id: q for q in load_split(str(bird_dir), "dev")}
    cfg = ours.recipe_config().scorer

    async def score_all(pool) -> list[float]:
        cache = GoldCache()
        groups = await asyncio.gather(*(score_group(pool, by_id[r["question_id"]].db_path, by_id[r["question_id"]].sql,
                                                    [""] * len(r["sample_sqls"]), cache, answers=list(r["sample_sqls"]))
                                        for r in rows))
        return [x for g in groups for x in g.rewards]

    with SqlPool(workers=2, timeout_s=cfg.timeout_s, max_rows=cfg.max_rows, memory_mb=cfg.memory_mb) as pool:
        rewards = asyncio.run(score_all(pool))
    return sum(rewards) / len(rewards) if rewards else 0.0


# -- the differences that remain ------------------------------------------------------------------


def differences(rows: list[dict], peer: dict | None) -> list[str]:
    import importlib.metadata as md

    out = [
        "Engines: ours generates with our transformers engine (each prompt prefilled once for its n samples, finished "
        "rows leave the batch, up to generator.max_batch_rows=128 rows a batch) and trains with DeepSpeed "
        "ZeRO-0 fp32 on packed rows that hold each group's prompt once, one sdpa per attention segment; TRL generates with model.generate on the "
        "whole 128-row batch (each prompt repeated 8 times, left-padded) and trains on padded rows.",
        "Scoring: ours scores each prompt's group in the scorer actor as it finishes (overlapped with generation); "
        "TRL calls the same score_group after the whole batch is generated (same sandbox, 1 worker, 5 s, 1 GB).",
        "Zero-variance groups: ours filters them out of the batch (assembler.filter_zero_variance); TRL keeps them "
        "with advantage 0, so their tokens count in the token-mean denominator (the same gradient direction, a "
        "smaller step).",
        "Optimizer state: both start from a fresh AdamW (torch.optim.AdamW) at the export; the recipe proper carries "
        "the warm start's Adam moments into RL.",
        "Threads: every one of our actors runs with OMP_NUM_THREADS=1 (the launcher's default, launch/local_ray.py "
        "run_env); TRL's one process ran with OMP_NUM_THREADS=" + TRL_THREADS
        + (f" (torch intra-op threads {peer['meta']['torch_threads']})" if peer else "")
        + " (PEERS_TRL_THREADS; torch's default is one per core).",
        "Processes: ours is a launcher, Ray (GCS, raylet, dashboard and its agents, workers), an embedded "
        "redis-server and one actor process each for the coordinator, generator, scorer (+ its SQL worker), "
        "assembler and learner; TRL is one process (+ its SQL worker).",
        "Held-out evaluation during training: the recipe evaluates every 10 steps (74 prompts greedy + 4 samples "
        "each); TRL evaluates nothing during training (its eval_strategy is 'no'); the eval_every=0 row removes it.",
        "RNG: the samples differ (different sampling code and seeds); "
        + (f"{len(SEEDS)} RL seeds per side ({', '.join(map(str, SEEDS))}), one warm-started export." if SEEDS != [None]
           else "one seed per side."),
    ]
    if peer:
        v = peer["meta"]["versions"]
        ours_tf = md.version("transformers")
        out.append(f"Versions: TRL {v['trl']}, accelerate {v['accelerate']}, datasets {v['datasets']}; transformers "
                   f"{v['transformers']} (TRL side) and {ours_tf} (ours), torch {v['torch']} on both.")
        mism = peer["meta"]["prompt_ids_mismatched"]
        out.append(f"Prompt tokens: TRL tokenizes the prompt text itself; {mism} of {peer['meta']['prompts']} prompts' "
                   "ids differ from ours." if mism else
                   f"Prompt tokens: TRL's tokenization of every prompt ({peer['meta']['prompts']}) equals our ids.")
    for r in rows:
        if r.get("prompts_trained") is not None:
            out.append(f"{r['name']}: {r['prompts_trained']} of {STEPS * 16} prompts trained (the rest filtered).")
    return out


# -- the one command --------------------------------------------------------------------------------


def profile_md(row: dict) -> str:
    lines = ["| s after start | gap, s | what | from |", "| ---: | ---: | --- | --- |"]
    lines += [f"| {m['at_s']:.1f} | {m.get('gap_s', 0):.1f} | {m['what']} | {m.get('source', '')} |"
              for m in row.get("startup", [])]
    if row.get("peak_breakdown"):
        lines += ["", f"Peak RSS {row['peak_rss_gb']:.2f} GB at {row.get('peak_at_s', 0):.0f} s, by process (MB): "
                  + ", ".join(f"{n} {mb}" for n, mb in row["peak_breakdown"])]
    ps = row.get("per_step") or {}
    if ps:
        lines += ["", "| per step | median s | total s |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {v['median']:.3f} | {v['total']:.1f} |" for k, v in ps.items()]
    return "\n".join(lines)


def write_results(out: Path, result: dict, runs: list[dict]) -> str:
    """peers.json and peers.md from the seeds run so far; returns the table's text."""
    result["load_after_runs"] = os.getloadavg()
    rows, peer = runs[0]["rows"], runs[0]["peer"]
    texts = [table.report(r["rows"], r["peer"], []) for r in runs]
    if len(runs) > 1:
        texts.append("Over the seeds (mean, min-max):\n\n" + table.over_seeds(runs))
    text = "\n\n".join(texts + ["Setup differences that remain:\n" + "\n".join(f"- {d}" for d in differences(rows, peer))])
    result["rows"], result["peer"], result["seeds"] = rows, peer, runs
    (out / "peers.json").write_text(json.dumps(result, indent=1, default=str))
    md = [text, "", "## Start-up and per-step profile of our run", "", profile_md(rows[0]),
          "", "## The warm-start export run (tiny with its warm start)", "", profile_md(result["export"])]
    if peer:
        md += ["", "## TRL's start-up", "", profile_md(peer)]
    (out / "peers.md").write_text("\n".join(md) + "\n")
    return text


def main() -> int:
    out = Path(os.environ.get("OUT", "") or tempfile.mkdtemp(prefix="arl-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    root = out / "runs"
    root.mkdir(exist_ok=True)
    per_step = settings(STEPS)
    samples_per_step = per_step["prompts_per_step"] * per_step["n_samples"]
    venv = None
    if "trl" in SIDES:
        try:
            vers = ensure_venv(DEFAULT_VENV, offline=os.environ.get("PEERS_OFFLINE", "") not in ("", "0"), log=log)
        except PeerVenvUnavailable as e:
            print(f"error: peer venv: {e}", file=sys.stderr)
            return 1
        venv = DEFAULT_VENV
        log(f"peer venv {venv}: {vers}")
    result: dict = {"steps": STEPS, "smoke": SMOKE, "settings": per_step, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_before": os.getloadavg(), "cpus": os.cpu_count()}
    log(f"byte-compiled the project's sources: {ours.compile_sources()}")
    result["export"] = make_export(root)
    bird_dir = root / "warm" / "data"
    runs = []  # one {"seed", "rows", "peer", "load"} per seed
    for seed in SEEDS:
        named = [(name + ("" if seed is None else f" (seed {seed})"), extra + seed_overrides(seed))
                 for name, extra in our_variants()]
        rows = [run_ours(root, name, extra, i, samples_per_step, seed) for i, (name, extra) in enumerate(named)]
        peer = run_trl(root, venv, samples_per_step, seed) if venv is not None else None
        load = os.getloadavg()
        for r in rows + ([peer] if peer else []):
            log(f"launch.eval: {r['name']}")
            r.update(evaluate(r["model"], bird_dir, out / "eval" / f"trl{seed_tag(seed)}"
                              if r["side"] == "trl" else out / "eval" / Path(r["model"]).parent.parent.name))
        runs.append({"seed": seed, "rows": rows, "peer": peer, "load_after": load})
        text = write_results(out, result, runs)  # after every seed: a run cut short keeps the seeds it finished
    print(text)
    print(f"\nfull results: {out / 'peers.json'}\nprofile: {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
