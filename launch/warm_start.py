"""The tiny recipe's supervised warm start: a few steps of cross-entropy on the training split's gold
SQL before RL, so a randomly initialised model writes SQL often enough for GRPO to have a signal.

Invariants: it runs only for `model.source == "tiny"` with `model.tiny_sft_steps > 0` (anything else
returns {} and changes nothing); every step goes through the learner group's `sft_step` (all ranks);
the pairs are (prompt ids, " " + gold SQL ids + eos), drawn with `seed`, so a rerun is the same.
"""
from __future__ import annotations

import time

from launch.config import RunConfig


def sft_pairs(cfg: RunConfig, items: list, model_path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, gold SQL ids + eos) for the tiny recipe's supervised warm-start."""
    from transformers import AutoTokenizer

    from queues.messages import unpack_ids

    tok = AutoTokenizer.from_pretrained(model_path)
    pairs = []
    for it in items:
        target = tok.encode(" " + it.gold_sql, add_special_tokens=False) + [tok.eos_token_id]
        pairs.append((unpack_ids(it.prompt_tokens).tolist(), target))
    return pairs


def warm_start(cfg: RunConfig, learner, items: list, model_path: str, log) -> dict[str, float]:
    """The tiny recipe's supervised warm-start on gold SQL, so RL starts with some signal."""
    import asyncio
    import random

    steps = cfg.model.tiny_sft_steps
    if cfg.model.source != "tiny" or steps <= 0:
        return {}
    pairs = sft_pairs(cfg, items, model_path)
    rng = random.Random(cfg.seed)
    batch = 16
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        chunk = rng.sample(pairs, min(batch, len(pairs)))
        losses.append(asyncio.run(learner.sft_step(chunk, cfg.model.tiny_sft_lr)))
        if (i + 1) % max(1, steps // 5) == 0:
            log.info("warm-start", step=i + 1, of=steps, loss=round(sum(losses[-20:]) / len(losses[-20:]), 4))
    return {"sft_loss_first": losses[0], "sft_loss_last": sum(losses[-10:]) / len(losses[-10:]),
            "time_sft": time.perf_counter() - start}
