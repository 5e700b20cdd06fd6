"""The task pack of bench/gpu/warm_start.py: the gpu1_0p6b recipe's task as the launcher builds it, in files
a device with only torch, transformers and tokenizers can read.

    .venv/bin/python -m bench.gpu.warm_start --prepare runs/warm_task [--seed S] [key=value ...]

Invariants:
- `prepare` builds with the launcher's own functions for RECIPE with `seed=S` and the run's overrides
  (e.g. data.synthetic_templates=[0,1,2] data.synthetic_databases=8: the task a run with them trains on) (launch.run.
  prepare_model_and_data: the databases and the tokenizer; load_prompts: every training and held-out prompt;
  launch.warm_start.sft_pairs: the warm start's (prompt, gold, slip) pairs), so the pack is the run's task
  exactly; it needs the project's venv (config, tasks.bird and queues.messages import msgspec).
- DIR/task.json holds those, the recipe's model shape, warm start, learner, generator and scorer settings,
  and tiny's model shape and warm start (CALIBRATE=1); databases and the tokenizer lie beside it. ~1.5 MB.
- `load_task` needs only the standard library: a missing pack is one line naming the command that makes
  it (or, where msgspec imports, the pack is made on the spot).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

RECIPE = "gpu1_0p6b"
SMALL_SHAPE = dict(tiny_hidden_size=64, tiny_layers=2, tiny_heads=4, tiny_kv_heads=2, tiny_intermediate_size=128)


def prepare(task_dir: Path, seed: int | None = None, recipe: str = RECIPE, overrides: list[str] = ()) -> Path:
    """Writes the task pack (module docstring) with the project's own functions; needs the project's venv."""
    import structlog

    from config import apply_overrides
    from config.recipes import get_recipe
    from launch.run import load_prompts, prepare_model_and_data
    from launch.warm_start import sft_pairs
    from queues.messages import unpack_ids

    cfg = apply_overrides(get_recipe(recipe), list(overrides) + ([] if seed is None else [f"seed={seed}"]))
    build = apply_overrides(cfg, [f"model.{k}={v}" for k, v in SMALL_SHAPE.items()])  # the tokenizer is
    log = structlog.get_logger("gpu_warm_start")  # the run's whatever the shape; a small model is built beside it
    task_dir = Path(task_dir).absolute()
    shutil.rmtree(task_dir, ignore_errors=True)
    run_dir = task_dir / "run"
    model_path, bird_dir = prepare_model_and_data(build, run_dir, log)
    train, held = load_prompts(cfg, model_path, bird_dir, log)
    pairs = sft_pairs(cfg, train, model_path)
    for f in Path(model_path).iterdir():  # keep the tokenizer only
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin") or f.name == "generation_config.json":
            f.unlink()

    def rows(items):
        return [{"prompt_id": it.prompt_id, "prompt": unpack_ids(it.prompt_tokens).tolist(), "gold_sql": it.gold_sql,
                 "db": os.path.relpath(it.db_path, task_dir)} for it in items]
    m, lr = cfg.model, cfg.learner

    def shape(model_cfg) -> dict:
        return {k: getattr(model_cfg, k) for k in ("tiny_hidden_size", "tiny_layers", "tiny_heads", "tiny_kv_heads",
                                                    "tiny_intermediate_size", "tiny_vocab_size")}
    tiny = get_recipe("tiny")  # CALIBRATE=1: tiny's own warm start on this (tiny's) task, against docs/perf/tiny.md
    task = {"recipe": recipe, "seed": cfg.seed, "overrides": list(overrides), "tokenizer": os.path.relpath(model_path, task_dir),
            "model": shape(m), "tiny": {"model": shape(tiny.model), "sft_lr": tiny.model.tiny_sft_lr,
                                        "sft_steps": tiny.model.tiny_sft_steps, "sft_slip": tiny.model.tiny_sft_slip,
                                        "learner": {"betas": list(tiny.learner.betas), "grad_clip": tiny.learner.grad_clip,
                                                    "weight_decay": tiny.learner.weight_decay}},
            "sft": {"steps": m.tiny_sft_steps, "lr": m.tiny_sft_lr, "slip": m.tiny_sft_slip, "batch": m.tiny_sft_batch},
            "learner": {"lr": lr.lr, "betas": list(lr.betas), "weight_decay": lr.weight_decay, "grad_clip": lr.grad_clip},
            "generator": {"max_tokens": cfg.generator.max_tokens, "temperature": cfg.generator.temperature,
                          "eval_samples": cfg.data.eval_samples},
            "scorer": {"workers": cfg.scorer.workers, "timeout_s": cfg.scorer.timeout_s, "memory_mb": cfg.scorer.memory_mb},
            "pairs": [list(p) for p in pairs], "train": rows(train), "eval": rows(held)}
    (task_dir / "task.json").write_text(json.dumps(task))
    return task_dir


def load_task(task_dir: Path) -> dict:
    path = Path(task_dir) / "task.json"
    if not path.is_file():
        try:
            import msgspec  # noqa: F401 - the project's venv can build the pack here
        except ImportError:
            sys.exit(f"error: TASK={task_dir}: no task.json; make it with `.venv/bin/python -m bench.gpu.warm_start "
                     f"--prepare {task_dir}` and carry the folder")
        prepare(task_dir)
    task = json.loads(path.read_text())
    for split in ("train", "eval"):
        for it in task[split]:
            it["db"] = str((Path(task_dir) / it["db"]).resolve())
    task["tokenizer"] = str(Path(task_dir) / task["tokenizer"])
    return task
