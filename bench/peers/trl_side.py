"""The TRL side of the peer bench: TRL's GRPOTrainer on tiny's task, run by the peer venv's python.

    <peer venv>/bin/python bench/peers/trl_side.py SPEC.json

SPEC (written by bench/peers/__main__.py): the warm export to start from, the prompts in our
coordinator's order (text, our token ids, database, gold SQL), the recipe's settings, the output dir.

Invariants:
- Imports nothing of the project but the reward code, called as a function: tasks/sandbox.py's
  score_group (the function our scorer calls: gold once, each distinct SQL once, in the read-only
  sandbox with tiny's scorer limits) over policies/sql_reward.py. Both are stdlib-only; the repo root is
  put on sys.path for them alone. TRL, datasets and accelerate are never imported by project code.
- Settings mirror the recipe: prompts_per_step prompts x n_samples per step, one generation batch per
  optimizer step and one update per batch (num_iterations=1; `micro_batch` rows a forward/backward, the
  rest gradient accumulation), max_tokens new tokens, the recipe's temperature / top_p, lr constant without
  warmup, AdamW betas, weight decay and grad clip as ours, clip epsilon low/high, no KL (beta=0),
  token-mean loss over the batch (loss_type "dapo"), group-std advantages; on CPU float32 and
  model.generate; with spec["vllm"] (the H200, bench/peers/gpu.py) bf16 on CUDA, gradient checkpointing
  as given, and TRL's vLLM in colocate mode (the engine in this process, sleeping while TRL trains:
  `enable_sleep_mode`, its share of the device `gpu_memory_utilization`) with the importance-sampling
  correction token-truncated at `correction_cap` (our `learner.correction=tis`).
- Prompts are taken in the spec's order (shuffle_dataset=False); each prompt's TRL token ids are
  checked against ours and the count of mismatches is reported, never silently ignored.
- Writes OUT/trl_steps.jsonl (one line per optimizer step: wall time, TRL's logged scalars),
  OUT/trl_meta.json (versions, load/ready times, prompt check, the CUDA allocator's peak when on a GPU) and,
  unless spec["save"] is false, the final model to OUT/final (with the export's tokenizer files and
  arctic_rl.json, so launch.eval renders the same prompts).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

T_START = time.time()
REPO = Path(__file__).resolve().parents[2]


def reward_function(spec: dict):
    """Our reward as TRL calls a reward function: one score per completion, each prompt's group scored
    together by tasks.sandbox.score_group, exactly as our scorer does."""
    import asyncio

    sys.path.insert(0, str(REPO))
    from tasks.sandbox import GoldCache, SqlPool, score_group

    scorer = spec["settings"]["scorer"]
    pool = SqlPool(workers=scorer["workers"], timeout_s=scorer["timeout_s"], max_rows=scorer["max_rows"],
                   memory_mb=scorer["memory_mb"])
    cache = GoldCache()

    def sql_reward(prompts, completions, db_path, gold_sql, **_):
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, key in enumerate(zip(prompts, db_path, gold_sql)):
            groups.setdefault(key, []).append(i)

        async def score_all():
            keys = list(groups)
            got = await asyncio.gather(*(score_group(pool, k[1], k[2], [completions[i] for i in groups[k]], cache)
                                         for k in keys))
            out = [0.0] * len(completions)
            for k, g in zip(keys, got):
                for i, r in zip(groups[k], g.rewards):
                    out[i] = float(r)
            return out

        return asyncio.run(score_all())

    sql_reward.__name__ = "sql_reward"
    return sql_reward, pool


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    t_imported = time.time()
    model_dir = spec["model"]
    vllm = spec.get("vllm")
    on_gpu = spec.get("device", "cpu") == "cuda"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32)
    t_loaded = time.time()

    prompts = spec["prompts"]
    # TRL's own tokenization of a text prompt (GRPOTrainer._tokenize_prompts: processing_class(text=...))
    mismatched = sum(tok(text=p["prompt"])["input_ids"] != p["prompt_ids"] for p in prompts)
    data = Dataset.from_list([{"prompt": p["prompt"], "db_path": p["db_path"], "gold_sql": p["gold_sql"]}
                              for p in prompts])
    s = spec["settings"]
    per_step = s["prompts_per_step"] * s["n_samples"]
    micro = int(s.get("micro_batch") or per_step)
    if per_step % micro:
        raise SystemExit(f"error: settings.micro_batch={micro} does not divide {per_step} samples a step")
    engine = {} if not vllm else dict(
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=vllm["gpu_memory_utilization"],
        vllm_enable_sleep_mode=vllm["enable_sleep_mode"], vllm_max_model_length=vllm.get("max_model_len"),
        vllm_importance_sampling_correction=vllm.get("correction_cap") is not None,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=vllm.get("correction_cap"))
    args = GRPOConfig(
        output_dir=str(out / "trainer"), seed=s["seed"], use_cpu=not on_gpu, bf16=on_gpu, fp16=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,
        steps_per_generation=per_step // micro, **engine,
        num_generations=s["n_samples"], num_iterations=1, max_steps=s["steps"], shuffle_dataset=False,
        max_completion_length=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta1=s["betas"][0],
        adam_beta2=s["betas"][1], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
        epsilon=s["clip_low"], epsilon_high=s["clip_high"], beta=0.0, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=bool(s.get("gradient_checkpointing", False)), logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    reward, pool = reward_function(spec)
    steps_file = open(out / "trl_steps.jsonl", "w")

    class StepTimes(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            steps_file.write(json.dumps({"step": state.global_step, "time": time.time(), **{
                k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}}) + "\n")
            steps_file.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[StepTimes()])
    t_ready = time.time()
    trainer.train()
    t_trained = time.time()
    steps_file.close()
    pool.close()
    if spec.get("save", True):
        final = out / "final"
        trainer.save_model(str(final))
        for f in Path(model_dir).iterdir():  # tokenizer files and arctic_rl.json the trainer did not write
            if f.is_file() and not (final / f.name).exists() and not f.name.endswith(".safetensors"):
                shutil.copy2(f, final / f.name)
    packages = ("trl", "transformers", "torch", "datasets", "accelerate") + (("vllm",) if vllm else ())
    meta = {"versions": {k: md.version(k) for k in packages}, "device": "cuda" if on_gpu else "cpu",
            "vllm": bool(vllm), "micro_batch": micro, "gradient_accumulation_steps": per_step // micro,
            "cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
            "t_start": T_START, "t_imported": t_imported, "t_loaded": t_loaded, "t_ready": t_ready,
            "t_trained": t_trained, "t_saved": time.time(), "prompts": len(prompts),
            "prompt_ids_mismatched": int(mismatched), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}
    (out / "trl_meta.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
